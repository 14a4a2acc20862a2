"""Which checkpoints a session's cells still are: the record behind a rollback that keeps
the cells (`Residency.rewind_to`).

Per session, the checkpoints saved from its state, each with the state's length then and
its epoch (`SeqState.epoch`, changed whenever cells are taken away): while the epoch is the
same, the session's cells below that length are the checkpoint's state, byte for byte.
"""

from __future__ import annotations

from kvkeepd.sessions.session import Session


class Lineage:
    """The checkpoints each session's cells still are, owned by the Residency."""

    def __init__(self) -> None:
        self._saved: dict[str, dict[str, tuple[int, int]]] = {}

    def remember(self, session: Session, checkpoint_id: str) -> None:
        """The checkpoint was just saved from the session's state, as it is now."""
        state = session.state
        if state.n_kv:
            kept = self._saved.get(session.session_id, {})
            kept = {cid: e for cid, e in kept.items() if e[1] == state.epoch}  # the rest are stale
            self._saved[session.session_id] = kept | {checkpoint_id: (state.n_kv, state.epoch)}

    def remembers(self, session: Session, checkpoint_id: str) -> bool:
        """Whether the checkpoint was saved from the session's state (it may be stale)."""
        return checkpoint_id in self._saved.get(session.session_id, {})

    def holds(self, session: Session, checkpoint_id: str, n_kv: int) -> bool:
        """Whether the session's cells below n_kv are still the checkpoint's state."""
        return self._saved.get(session.session_id, {}).get(checkpoint_id) == (n_kv, session.state.epoch)

    def cut(self, session: Session, epoch: int, n_kv: int) -> None:
        """The session's cells (of `epoch`) were cut to n_kv and its epoch moved on: the
        checkpoints within n_kv are still its cells, under the new epoch."""
        saved = self._saved.get(session.session_id, {})
        now = session.state.epoch
        self._saved[session.session_id] = {
            cid: (m, now) for cid, (m, e) in saved.items() if e == epoch and m <= n_kv
        }

    def forget(self, session: Session) -> None:
        self._saved.pop(session.session_id, None)
