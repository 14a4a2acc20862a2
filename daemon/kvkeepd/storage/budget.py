"""The disk budget: every byte the daemon keeps on disk, held under `--disk-budget`.

What counts: the durable store's blocks, the spill area's blocks, the catalog database
(manifests with their logits, and its write-ahead log) and the turn journal. A write reserves what it may add
before it starts (an upper bound: the pieces the store lacks, raw, and the manifest); when
that would pass the budget, blocks no checkpoint references are dropped, least recently
used first, and a write that still does not fit is refused with Busy. Writes of different
stores may run at once in worker threads: reservations are counted until their write ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

from kvkeepd.errors import Busy


def state_bound(state_bytes: int, n_tokens: int, n_vocab: int) -> int:
    """The most a stored state takes: its pieces raw, and a manifest of its tokens (4 bytes
    each, twice over with the catalog's log), logits and metadata."""
    return state_bytes + 8 * n_tokens + 4 * n_vocab + (1 << 16)


class DiskBudget:
    """Bytes on disk, and the reservations of writes under way."""

    def __init__(self, limit: int, parts: Sequence[Callable[[], int]], sweep: Callable[[int], int]) -> None:
        """`parts`: each returns bytes it holds now; `sweep(target)`: drop unreferenced
        blocks until what `parts` hold is at most `target` (or none is left to drop)."""
        self.limit = limit
        self._parts = parts
        self._sweep = sweep
        self._lock = threading.Lock()
        self._reserved = 0

    def used(self) -> int:
        """Bytes held on disk now."""
        return sum(part() for part in self._parts)

    @contextlib.contextmanager
    def reserve(self, n: int) -> Iterator[None]:
        """Hold room for a write of at most `n` bytes while it runs; Busy if there is none."""
        with self._lock:
            if self.used() + self._reserved + n > self.limit:
                self._sweep(self.limit - self._reserved - n)
            used = self.used()
            if used + self._reserved + n > self.limit:
                raise Busy(
                    f"the disk budget of {self.limit} bytes is used up ({used} held, {n} more "
                    "needed): delete checkpoints or close persistent sessions"
                )
            self._reserved += n
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= n

    def fits(self, n: int) -> bool:
        """Whether a write of `n` bytes would fit now (sweeping if that makes room)."""
        try:
            with self.reserve(n):
                return True
        except Busy:
            return False
