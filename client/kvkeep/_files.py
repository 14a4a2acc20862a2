"""Where checkpoint exports go and imports come from: a path or an open binary file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import BinaryIO, TypeAlias

PathOrFile: TypeAlias = str | os.PathLike[str] | BinaryIO
"""A filesystem path, or a binary file object the caller opened and will close."""

CHUNK_BYTES = 1 << 20


@contextlib.contextmanager
def open_destination(dest: PathOrFile) -> Iterator[BinaryIO]:
    """A file to write into; a path is written to a temporary file, renamed over it on success."""
    if not isinstance(dest, str | os.PathLike):
        yield dest
        return
    path = os.fspath(dest)
    # In the same directory, so the final rename is atomic and a failed export
    # never leaves a truncated checkpoint under the real name.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".kvkeep-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def open_source(src: PathOrFile) -> Iterator[BinaryIO]:
    """A file to read from; a path is opened (and closed) here."""
    if isinstance(src, str | os.PathLike):
        with open(src, "rb") as f:
            yield f
    else:
        yield src
