"""Whole states of ephemeral sessions' recent checkpoints, kept in the RAM budget's free room.

An ephemeral session's checkpoint is stored as blocks, which later checkpoints of the same
history and the prefix cache share. Loading it means assembling those blocks into the one
blob llama.cpp takes, about half of a restore from RAM. When the checkpoint is taken, that
blob exists already: the slot's own export. It is kept here, in the part of `--ram-cache`
that parked states and stored blocks leave free, and given up first when they need room
(least recently used first). A restore or a fork that finds its checkpoint here loads the
blob as it is. Persistent sessions' checkpoints are not kept: they are the disk tier, read
from their blocks as after a restart.

Entries are keyed by checkpoint id (never reused), and reached only through a checkpoint
the tenant's lookup found. Owned by the Residency, on the event loop.
"""

from __future__ import annotations

from collections import OrderedDict

from kvkeepd.heap import allocated
from kvkeepd.state.cells import SeqKv


class StateCache:
    """Checkpoint id -> its whole state (a SeqKv with its raw blob), least recently used first."""

    def __init__(self) -> None:
        self._states: OrderedDict[str, tuple[str, SeqKv]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._states)

    def put(self, checkpoint_id: str, session_id: str, kv: SeqKv, room: int) -> bool:
        """Keep a checkpoint's state if it has a blob llama.cpp takes as it is and fits in
        `room` bytes (what the cache may hold in all), giving up older states for it."""
        if kv.raw is None or _size(kv) > room:
            return False
        self.shrink(room - _size(kv))
        self._states[checkpoint_id] = (session_id, kv)
        self.nbytes += _size(kv)
        return True

    def __contains__(self, checkpoint_id: str) -> bool:
        return checkpoint_id in self._states

    def get(self, checkpoint_id: str) -> SeqKv | None:
        """The checkpoint's whole state, if kept (it becomes the most recently used)."""
        found = self._states.get(checkpoint_id)
        if found is None:
            return None
        self._states.move_to_end(checkpoint_id)
        self.hits += 1
        return found[1]

    def shrink(self, limit: int) -> None:
        """Give up the least recently used states until at most `limit` bytes are kept."""
        while self._states and self.nbytes > limit:
            _, (_, kv) = self._states.popitem(last=False)
            self.nbytes -= _size(kv)

    def drop(self, checkpoint_id: str) -> None:
        found = self._states.pop(checkpoint_id, None)
        if found is not None:
            self.nbytes -= _size(found[1])

    def drop_session(self, session_id: str) -> None:
        """Forget the states of a session's checkpoints (it closed: they are gone)."""
        for checkpoint_id in [c for c, (s, _) in self._states.items() if s == session_id]:
            self.drop(checkpoint_id)


def _size(kv: SeqKv) -> int:
    assert kv.raw is not None
    return allocated(kv.raw)
