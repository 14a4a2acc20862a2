"""The C heap under the daemon: how glibc keeps freed memory, and how much it holds.

Resident memory alone cannot tell a leak from memory glibc keeps for reuse (which the daemon
asks it to do, see `keep_freed_memory`), so the heap's own figures are reported beside it:
bytes in use by the program and bytes free but kept.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass


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


def heap_usage() -> HeapUsage | None:
    """The heap's bytes in use and free, from mallinfo2 (None where glibc lacks it)."""
    libc = _libc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return HeapUsage(in_use=info.uordblks + info.hblkhd, free=info.fordblks)
