"""Blocks as files under `blocks/`, named by key, written atomically.

A write goes to `tmp/` (0600), is fsynced, renamed into place and the directory fsynced (and
the store's root, when the rename's directory is new), so a block file is either absent or
whole. Temp files left by a crash are swept at start. A block that exists but cannot be read
is StoreReadFailed, not corruption: the bytes may be fine once the disk is.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvkeepd.errors import StoreReadFailed
from kvkeepd.files import StateDirError, fsync_dir, private_subdir, refusal, write_new
from kvkeepd.storage.blocks.base import check_key

log = logging.getLogger(__name__)

# File reads release the GIL: a restore's blocks are read on every core.
_READERS = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvkeep-file")


# The most buffers one preadv takes (Linux's UIO_MAXIOV).
_IOV_MAX = 1024


def _after(parts: Sequence[memoryview], skip: int) -> list[memoryview]:
    """`parts` less their first `skip` bytes."""
    out = []
    for p in parts:
        if skip >= len(p):
            skip -= len(p)
            continue
        out.append(p[skip:])
        skip = 0
    return out


class LocalBlockStore:
    """Blocks under `root` (which the start checks, with the state directory's other fixed
    entries: statedir.check_entries). Nothing under it is followed: a block file that is a
    link refuses the start, reads open with O_NOFOLLOW, and a key prefix's directory is
    checked with lstat when a write makes it (see statedir's docstring for what that covers)."""

    in_process = False
    remote = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        private_subdir(root)
        private_subdir(self.tmp)
        swept = 0
        for stale in self.tmp.iterdir():
            stale.unlink(missing_ok=True)
            swept += 1
        if swept:
            log.info("swept %d unfinished block writes", swept)
        self._bytes = 0
        for path in self._files():
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):  # a block file that is a link refuses the start
                raise StateDirError(refusal(path, st.st_mode, directory=False))
            self._bytes += st.st_size

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key

    def _files(self) -> Iterator[Path]:
        with os.scandir(self.root) as subs:
            prefixes = [s.name for s in subs if s.name != "tmp" and s.is_dir(follow_symlinks=False)]
        for name in prefixes:
            with os.scandir(self.root / name) as entries:
                yield from [self.root / name / e.name for e in entries]

    def has(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._path(key)).st_mode)
        except FileNotFoundError:
            return False

    def get(self, key: str) -> bytes:
        fd = self._open(key)
        try:
            with open(fd, "rb") as f:
                return f.read()
        except OSError as e:
            log.error("cannot read block %s: %s", self._path(key), e)
            raise StoreReadFailed("the state store cannot be read (see the daemon's log)") from None

    def _open(self, key: str) -> int:
        path = self._path(key)
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KeyError(key) from None
        except OSError as e:  # a link (ELOOP) among them
            log.error("cannot read block %s: %s", path, e)
            raise StoreReadFailed("the state store cannot be read (see the daemon's log)") from None

    def read_into(self, key: str, parts: Sequence[memoryview]) -> bool:
        fd = self._open(key)
        try:
            size = os.fstat(fd).st_size
            if size != sum(len(p) for p in parts) or len(parts) > _IOV_MAX:
                return False
            done = 0
            while done < size:  # preadv may stop short (a signal): the rest is read on
                got = os.preadv(fd, _after(parts, done), done)
                if not got:
                    return False
                done += got
            return True
        except OSError as e:
            log.error("cannot read block %s: %s", self._path(key), e)
            raise StoreReadFailed("the state store cannot be read (see the daemon's log)") from None
        finally:
            os.close(fd)

    def present(self, keys: Sequence[str]) -> set[str]:
        return {k for k in keys if self.has(k)}

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        def read(key: str) -> bytes | None:
            try:
                return self.get(key)
            except KeyError:
                return None

        found = zip(keys, _READERS.map(read, keys), strict=True)
        return {k: data for k, data in found if data is not None}

    def put(self, key: str, data: bytes) -> int:
        path = self._path(key)
        if self.has(key):
            return 0
        tmp = self.tmp / f"{key}.{secrets.token_hex(4)}"
        write_new(tmp, data)
        try:
            # StateDirError (an OSError: the write fails) if a link was planted there; the
            # rename replaces a link at the block's own path, never follows it.
            private_subdir(path.parent)  # fsyncs the root when the directory is new
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
            raise
        try:
            fsync_dir(path.parent)
        except BaseException:
            path.unlink(missing_ok=True)  # not known to be durable: not there at all
            raise
        self._bytes += len(data)
        return len(data)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            size = path.lstat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        self._bytes -= size

    def block_keys(self) -> Iterator[str]:
        return (p.name for p in list(self._files()))

    def total_bytes(self) -> int:
        return self._bytes
