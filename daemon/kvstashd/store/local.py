"""Blocks as files under `blocks/`, named by key, written atomically.

A write goes to `tmp/`, is fsynced, renamed into place and the directory fsynced, so a
block file is either absent or whole. Temp files left by a crash are swept at start.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from kvstashd.store import check_key

log = logging.getLogger(__name__)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlockStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        swept = 0
        for stale in self.tmp.iterdir():
            stale.unlink(missing_ok=True)
            swept += 1
        if swept:
            log.info("swept %d unfinished block writes", swept)
        self._bytes = sum(p.stat().st_size for p in self._files())

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key

    def _files(self) -> Iterator[Path]:
        for sub in self.root.iterdir():
            if sub.is_dir() and sub.name != "tmp":
                yield from sub.iterdir()

    def has(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def put(self, key: str, data: bytes) -> int:
        path = self._path(key)
        if path.is_file():
            return 0
        tmp = self.tmp / f"{key}.{secrets.token_hex(4)}"
        try:
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
            raise
        try:
            _fsync_dir(path.parent)
        except BaseException:
            path.unlink(missing_ok=True)  # not known to be durable: not there at all
            raise
        self._bytes += len(data)
        return len(data)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        self._bytes -= size

    def block_keys(self) -> Iterator[str]:
        return (p.name for p in list(self._files()))

    def total_bytes(self) -> int:
        return self._bytes
