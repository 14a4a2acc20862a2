"""The state directory: one daemon's alone, and private to the user it runs as.

A daemon locks the directory (`flock` on its `lock` file) before it touches anything else in
it, and holds the lock until it has stopped: a second daemon on the same directory refuses
to start, instead of wiping the first one's spill area and deleting its new blocks as
orphans. What a daemon creates there is private, directories 0700 and files 0600 (the
catalog holds conversations in plain text), and every new directory entry is made durable
by an fsync of the directory that holds it.

    state-dir/            0700
      lock                the holder's pid
      store.key           the HMAC key of manifests
      fingerprints.json   model fingerprints by path, size and mtime
      probes.json         the exactness probe's results (unless --probe-cache puts them elsewhere)
      catalog.db(-wal, -shm)
      blocks/             persistent sessions' and checkpoints' KV blocks
      spill/              ephemeral sessions' blocks: wiped at every start and graceful stop
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600


class StateDirError(Exception):
    """The state directory cannot be had (another daemon holds it); one line, for the operator."""


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a new file, a rename, a new subdirectory) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(path: Path) -> bool:
    """Make the directory and any missing parents (0700), each made durable in its parent.
    Returns whether `path` was created."""
    if path.is_dir():
        return False
    private_dir(path.parent)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        if path.is_dir():  # made by someone else in the meantime
            return False
        raise
    fsync_dir(path.parent)
    return True


def private_file(path: Path) -> None:
    """Create the file (empty, 0600) unless it exists, so that whatever opens it next (sqlite)
    finds it private; sqlite gives its -wal and -shm files the same mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return
    os.close(fd)
    fsync_dir(path.parent)


def write_private(path: Path, data: bytes) -> None:
    """Replace the file's contents atomically: a 0600 temp file, fsynced, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
        """Create (0700) and lock the directory; StateDirError if another daemon holds it.
        Nothing else in the directory is touched before the lock is held."""
        private_dir(path)
        _tighten(path)
        lock = path / "lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirError(
                f"the state directory {path} is in use by another kvstash daemon (pid {holder}); "
                "each daemon needs its own --state-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def wipe_spill(self) -> None:
        """Remove the spill area: ephemeral state never outlives the daemon that spilled it."""
        shutil.rmtree(self.spill, ignore_errors=True)

    def release(self) -> None:
        """Unlock (the lock file stays: removing it would let two daemons lock two files)."""
        if self._lock_fd is None:
            return
        fd, self._lock_fd = self._lock_fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


def _tighten(path: Path) -> None:
    """A state directory made before (or by hand) with group or other access becomes 0700,
    when it is ours to change."""
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, DIR_MODE)
        log.warning("state directory %s was mode %04o; it is now %04o", path, mode, DIR_MODE)
