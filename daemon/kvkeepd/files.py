"""Private files and directories: made 0600 and 0700, durable once made, never reached
through a symbolic link.

What the daemon keeps (the state directory, storage/statedir.py) holds conversations in plain
text and the key that vouches for manifests, so nothing is created readable by others, a new
directory entry is made durable by an fsync of the directory that holds it, and a link planted
where a file or a directory belongs is refused (StateDirError, one line naming it), never
followed: O_NOFOLLOW for files, lstat for directories. O_NOFOLLOW covers a path's last
component only; for the directories between, the state directory's own check at start and its
0700 are the defence. The model cache (kvkeepd.model.hub) keeps the same rules.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

DIR_MODE = 0o700
FILE_MODE = 0o600
#: Where a refused link was found, as its refusal says (the model cache keeps these rules too).
STATE_DIR = "its state directory"

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
)


class StateDirError(OSError):
    """The state directory cannot be had (another daemon holds it), or holds something the
    daemon will not follow or use; one line, for the operator. An OSError: met after start,
    by a store's write, it fails that write as a failing disk would."""


def refusal(path: Path, mode: int, *, directory: bool, place: str = STATE_DIR) -> str:
    """The line that refuses `path`, found to be of `mode`'s kind where the daemon keeps a
    directory (or a file) in `place`."""
    found = next((name for test, name in _KINDS if test(mode)), "a device")
    why = f" (the daemon follows no links in {place})" if stat.S_ISLNK(mode) else ""
    expected = "a directory" if directory else "a file"
    return f"{path} is {found} where the daemon keeps {expected}{why}: remove it and start again"


def check_entry(path: Path, *, directory: bool = False, place: str = STATE_DIR) -> bool:
    """Whether `path` exists (lstat, not following it); StateDirError if it is a symbolic link
    or not a regular file (with `directory`: not a directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        raise StateDirError(refusal(path, st.st_mode, directory=directory, place=place))
    return True


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a new file, a rename, a new subdirectory) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(path: Path) -> bool:
    """Make the directory and any missing parents (0700), each made durable in its parent.
    Returns whether `path` was created. Links on the way are followed: this is for the state
    directory's own path, the operator's (inside it, `private_subdir`)."""
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


def private_subdir(path: Path, *, place: str = STATE_DIR) -> bool:
    """Make the directory (0700) in its parent, which exists, unless it is there; returns
    whether it was made (then made durable in its parent). StateDirError if what is there is
    not a directory, a symbolic link included: what is written under it would land wherever
    the link points. (A link swapped in after this check is not seen: see the module's
    docstring.)"""
    try:
        os.mkdir(path, DIR_MODE)
        made = True
    except FileExistsError:
        made = False
    check_entry(path, directory=True, place=place)
    if made:
        fsync_dir(path.parent)
    return made


def open_private(path: Path, flags: int, *, place: str = STATE_DIR) -> int:
    """A descriptor of the file (`flags`, O_NOFOLLOW, O_CLOEXEC), created 0600 and made durable
    in its directory if absent. StateDirError if the path is a symbolic link or not a regular
    file: it is never followed, truncated or written through."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        check_entry(path, place=place)  # a link, a pipe, a directory: refused in one line, before an open
        fd = os.open(path, flags)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped in since the check
            os.close(fd)
            raise StateDirError(refusal(path, mode, directory=False, place=place)) from None
        return fd
    try:
        fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private(path: Path, *, place: str = STATE_DIR) -> bytes:
    """The file's bytes, read without following a link (StateDirError, as for anything but a
    regular file); FileNotFoundError if absent."""
    check_entry(path, place=place)
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
        return f.read()


def private_file(path: Path) -> None:
    """Create the file (empty, 0600) unless it exists, so that whatever opens it next (sqlite)
    finds it private; sqlite gives its -wal and -shm files the same mode. StateDirError if it
    is a symbolic link or not a regular file."""
    os.close(open_private(path, os.O_RDONLY))


def write_new(path: Path, data: bytes) -> None:
    """Make the file at `path`, 0600, holding `data`, fsynced (its directory is not: the caller
    renames it or syncs that). FileExistsError if anything is at `path`, a link among them:
    O_EXCL, so nothing planted there is written through. A write that fails removes the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_private(path: Path, data: bytes) -> None:
    """Replace the file's contents atomically: a new 0600 temp file beside it (a name of its
    own, made by `write_new`), renamed over it (a link at `path` is replaced, not followed)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    write_new(tmp, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
