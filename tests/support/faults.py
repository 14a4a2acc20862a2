"""Faults injected into the state directory's writes."""

from __future__ import annotations

import errno
import os
from typing import Any


class FailingFsync:
    """`os` as the block store and the journal see it, with fsync and fdatasync failing
    (EIO) while `failing` is set."""

    def __init__(self) -> None:
        self.failing = False
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        if self.failing:
            self.failed += 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        if self.failing:
            self.failed += 1
            raise OSError(errno.EIO, "Input/output error (injected)")
        os.fdatasync(fd)
