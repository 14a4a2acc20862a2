"""The C heap under the daemon: how glibc keeps freed memory, and how much it holds.

Resident memory alone cannot tell a leak from memory glibc keeps for reuse (which the daemon
asks it to do, see `keep_freed_memory`), so the heap's own figures are reported beside it:
bytes in use by the program and bytes free but kept.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np


class _Mallinfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (2.33+): every field a size_t, in this order.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@dataclass(frozen=True)
class HeapUsage:
    """What the C heap holds, over all of glibc's arenas."""

    in_use: int  # bytes handed out and not freed, mapped chunks included
    free: int  # bytes freed and kept for reuse (resident or not)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune or report
        return None


def keep_freed_memory() -> None:
    """Let glibc reuse freed KV blobs instead of returning them to the kernel.

    Blobs are tens of MB, above glibc's largest mmap threshold (32 MB), so each one was
    a fresh mapping whose page faults cost more than the copy into it (a 46 MB restore
    went from ~15 ms to ~100 ms whenever it faulted).
    """
    libc = _libc()
    if libc is None:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 2 << 30)


#: The sizes states are allocated in: a multiple of this, above it.
_STATE_CLASS = 16 << 20


def state_buffer(size: int, *, rounded: bool = False) -> np.ndarray:
    """`size` uninitialised bytes for a state llama.cpp writes; with `rounded`, in an
    allocation rounded up to a multiple of 16 MiB (`allocated` tells its size).

    A session whose state is exported every turn (a chain of stored responses) grows a
    little every turn. Allocated at its exact size, each state is a little larger than the
    one freed before it, so glibc cannot reuse that memory and takes memory new to the
    process, whose page faults cost more than the copy into it (a 60 MB export: 6-14 ms
    into touched memory, 60-180 ms into new memory on a virtual machine). Rounded, the
    next state fits where an earlier one was.
    """
    if rounded and size > _STATE_CLASS:
        return np.empty(-(-size // _STATE_CLASS) * _STATE_CLASS, dtype=np.uint8)[:size]
    return np.empty(size, dtype=np.uint8)


def allocated(buf: bytes | bytearray | memoryview) -> int:
    """The bytes of memory that hold `buf`: more than its length where `state_buffer`
    rounded its allocation up."""
    base = getattr(getattr(buf, "obj", None), "base", None)
    return max(len(buf), base.nbytes) if isinstance(base, np.ndarray) else len(buf)


def heap_usage() -> HeapUsage | None:
    """The heap's bytes in use and free, from mallinfo2 (None where glibc lacks it)."""
    libc = _libc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return HeapUsage(in_use=info.uordblks + info.hblkhd, free=info.fordblks)
