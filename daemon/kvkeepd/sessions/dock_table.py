"""Docks: which idle session each dock holds (a KV stream beside the slots, in device memory on
a GPU: engine/streams.py), and which to give up when all are taken.

A table of the Residency's, which alone changes it (with the session's placement, `Docked`).
"""

from __future__ import annotations

from kvkeepd.sessions.session import Session


class Docks:
    """The dock table: per dock, the session whose KV it holds, or None."""

    def __init__(self, n: int) -> None:
        self._held: list[Session | None] = [None] * n

    def __len__(self) -> int:
        return len(self._held)

    def free_place(self) -> int | None:
        """The first empty dock, or None."""
        return next((i for i, s in enumerate(self._held) if s is None), None)

    def victim(self, keep: Session | None = None) -> Session | None:
        """The least recently used docked session that is idle (its lock free: taking it does
        not wait) and not `keep`; None when there is none."""
        idle = [s for s in self._held if s is not None and not s.busy and s is not keep]
        return min(idle, key=lambda s: s.last_used_at) if idle else None

    def hold(self, place: int, session: Session) -> None:
        if self._held[place] is not None:
            raise ValueError(f"dock {place} is taken")
        self._held[place] = session

    def vacate(self, place: int) -> None:
        self._held[place] = None

    def owners(self) -> list[Session | None]:
        """Per dock, its session (for the checks)."""
        return list(self._held)
