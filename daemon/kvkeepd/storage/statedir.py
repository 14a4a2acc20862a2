"""The state directory: one daemon's alone, and private to the user it runs as.

A daemon locks the directory (`flock` on its `lock` file) before it touches anything else in
it, and holds the lock until it has stopped: a second daemon on the same directory refuses
to start, instead of wiping the first one's spill area and deleting its new blocks as
orphans. What a daemon creates there is private, directories 0700 and files 0600 (the
catalog holds conversations in plain text), and every new directory entry is made durable
by an fsync of the directory that holds it.

    state-dir/            0700
      lock                the holder's pid
      kvkeep-state        what the directory is, and its format ("kvkeep state 1")
      store.key           the HMAC key of manifests
      fingerprints.json   model fingerprints by path, size and mtime
      probes.json         the exactness probe's results, where --probe-cache put them before
                          (now in the user's cache directory by default)
      catalog.db(-wal, -shm)
      journal             persistent sessions' turns since their heads
      blocks/             persistent sessions' and checkpoints' KV blocks (tmp/, and one
                          directory per key prefix)
      spill/              ephemeral sessions' blocks: wiped at every start and graceful stop

Nothing in it is followed: a symbolic link planted there (by whoever else can write to it)
would send the journal's conversations, new blocks or the spill area's wipe wherever it
points. At start every fixed entry above is checked with lstat, and a link, or a thing of
another kind than the daemon keeps there, refuses the start (StateDirError, one line naming
it). After start, files are opened with O_NOFOLLOW (see `open_private`), new ones are made
with O_EXCL, and a directory made is checked with lstat (`private_subdir`). O_NOFOLLOW
covers a path's last component only: for the directories between (blocks/'s), the start's
check and the state directory's 0700 are the defence. The state directory's own path is
the operator's, and is followed (systemd's DynamicUser makes it a link).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
from pathlib import Path

from kvkeepd.files import (
    DIR_MODE,
    StateDirError,
    check_entry,
    open_private,
    private_dir,
    read_private,
    refusal,
    write_private,
)

log = logging.getLogger(__name__)

# What a state directory holds under fixed names: files, and directories.
FILES = (
    "lock",
    "kvkeep-state",
    "store.key",
    "fingerprints.json",
    "probes.json",
    "catalog.db",
    "catalog.db-wal",
    "catalog.db-shm",
    "catalog.db-journal",
    "journal",
    "journal.tmp",
)
DIRS = ("blocks", "spill")
MARK = "kvkeep-state"
MARK_TEXT = b"kvkeep state 1\n"


class StateDir:
    """A state directory this process holds the lock of (see `take`)."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd

    @property
    def spill(self) -> Path:
        return self.path / "spill"

    @classmethod
    def take(cls, path: Path) -> StateDir:
        """Create (0700) and lock the directory, then check its fixed entries (see the
        module's docstring); StateDirError if another daemon holds it or an entry is refused.
        Nothing else in the directory is touched before the lock is held."""
        try:
            private_dir(path)
            _tighten(path)
            fd = open_private(path / "lock", os.O_RDWR)
        except StateDirError:
            raise
        except OSError as e:
            # Unwritable, unreadable, a file in the way: say which setting chose the path.
            where = f" ({e.filename})" if e.filename and Path(e.filename) != path else ""
            why = "not a directory" if isinstance(e, FileExistsError) else (e.strerror or str(e)).lower()
            raise StateDirError(
                f"cannot use the state directory {path}{where}: {why}; choose another with --state-dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirError(
                f"the state directory {path} is in use by another kvkeep daemon (pid {holder}); "
                "each daemon needs its own --state-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            check_entries(path)
            _check_mark(path)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def wipe_spill(self) -> None:
        """Remove the spill area: ephemeral state never outlives the daemon that spilled it.
        Nothing is followed: a link there (planted since the start's check) is removed, not
        what it points to, and shutil's walk does not follow links inside either."""
        try:
            st = os.lstat(self.spill)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(self.spill, ignore_errors=True)
        else:
            log.warning("%s", refusal(self.spill, st.st_mode, directory=True))
            with contextlib.suppress(OSError):
                os.unlink(self.spill)

    def release(self) -> None:
        """Unlock (the lock file stays: removing it would let two daemons lock two files)."""
        if self._lock_fd is None:
            return
        fd, self._lock_fd = self._lock_fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


def check_entries(path: Path) -> None:
    """StateDirError for the first fixed entry of the state directory that is a symbolic link
    or not of the kind the daemon keeps there; blocks/ holds directories only (tmp/ and the
    key prefixes'), none of them a link."""
    for name in FILES:
        check_entry(path / name)
    for name in DIRS:
        check_entry(path / name, directory=True)
    blocks = path / "blocks"
    if blocks.is_dir():
        with os.scandir(blocks) as entries:
            for entry in entries:
                check_entry(blocks / entry.name, directory=True)


def _check_mark(path: Path) -> None:
    """A directory with state but without this format's mark (one of kvstash, the name this
    daemon had before, or of another format) is refused, not read: its manifests and exports
    carry other magic numbers. An empty one is marked."""
    mark = path / MARK
    try:
        found = read_private(mark)
    except FileNotFoundError:
        found = None
    if found == MARK_TEXT:
        return
    if found is not None:
        raise StateDirError(
            f"the state directory {path} is of another format ({found[:40]!r} in {MARK}): "
            "start with another --state-dir"
        )
    # (A store.key alone is no state: an operator puts a shared store's key there before
    # the first start.)
    if any(os.path.lexists(path / name) for name in ("catalog.db", "journal", "blocks")):
        raise StateDirError(
            f"the state directory {path} was written by an earlier version (kvstash), whose state "
            "kvkeep does not read: move it away, or start with another --state-dir"
        )
    write_private(mark, MARK_TEXT)


def _tighten(path: Path) -> None:
    """A state directory made before (or by hand) with group or other access becomes 0700,
    when it is ours to change."""
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, DIR_MODE)
        log.warning("state directory %s was mode %04o; it is now %04o", path, mode, DIR_MODE)
