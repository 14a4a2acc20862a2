"""Where a session's computed state is: one `Placement` value per session, kept with the slot
and dock tables in `Placements`, which its subclass the Residency (sessions/memory/residency.py)
alone writes; everyone else reads.

- `InSlot`: in an engine slot (hot);
- `Docked`: in a dock, a KV stream beside the slots (device memory on a GPU), after eviction
  (warm; engine/streams.py);
- `Parked`: parsed and checked, in RAM (warm), after eviction, a restore or a fork;
- `Stored`: in a checkpoint store (cold): a persistent session's head after a restart or a
  spill, or an ephemeral session's spill (a disk area wiped at every start);
- `HistoryOnly`: only the token history; the next generation evaluates it again.

Its `location` names it for people: "slot N", "dock", "ram", "disk", "shared store" (a remote
block store, which other daemons may read) or "history only".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvkeepd.engine.streams import StreamPlan
from kvkeepd.sessions.dock_table import Docks
from kvkeepd.sessions.session import Session
from kvkeepd.state import cells as kvstate
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage.checkpoints import CheckpointStore


@dataclass(frozen=True)
class InSlot:
    slot: int


@dataclass(frozen=True)
class Docked:
    place: int


@dataclass(frozen=True)
class Parked:
    kv: kvstate.SeqKv


@dataclass(frozen=True)
class Stored:
    store: CheckpointStore
    checkpoint_id: str
    snapshot: Snapshot


@dataclass(frozen=True)
class HistoryOnly:
    reason: str = ""


Placement = InSlot | Docked | Parked | Stored | HistoryOnly

#: Where a session's state is: in a slot, parked in RAM, or stored (or only its history).
Tier = Literal["hot", "warm", "cold"]

TIERS: dict[type, Tier] = {InSlot: "hot", Docked: "warm", Parked: "warm", Stored: "cold", HistoryOnly: "cold"}


#: The location of a state kept in a remote block store.
SHARED_STORE = "shared store"


def store_location(store: CheckpointStore) -> str:
    """Where a checkpoint store keeps its blocks: "shared store" (a remote one), "ram" or "disk"."""
    if store.store.remote:
        return SHARED_STORE
    return "ram" if store.store.in_process else "disk"


def location(where: Placement) -> str:
    """A placement as people read it: "slot N", "dock", "ram", "disk", "shared store" or
    "history only"."""
    match where:
        case InSlot(slot):
            return f"slot {slot}"
        case Docked():
            return "dock"
        case Parked():
            return "ram"
        case Stored(store):
            return store_location(store)
    return "history only"


class Placements:
    """Every session's placement, the slot table (the session in each slot) and the dock
    table: read by anyone, changed only by the Residency's moves. A session is in the slot
    table exactly while its placement is `InSlot` (and, during a load, while the slot is
    reserved for it), in the dock table exactly while it is `Docked`."""

    def __init__(self, streams: StreamPlan) -> None:
        self.streams = streams
        self._where: dict[str, tuple[Session, Placement]] = {}
        self._slots: list[Session | None] = [None] * streams.slots
        # Where evicted sessions go before RAM, where the engine has docks.
        self.docks = Docks(streams.docks)

    def where(self, session: Session) -> Placement:
        return self._where[session.session_id][1]

    def tier(self, session: Session) -> Tier:
        return TIERS[type(self.where(session))]

    def location(self, session: Session) -> str:
        return location(self.where(session))

    def stream(self, session: Session) -> int | None:
        """The engine sequence that holds the session's cells (its slot or dock), or None."""
        match self.where(session):
            case InSlot(slot):
                return slot
            case Docked(place):
                return self.streams.dock_id(place)
        return None

    @property
    def slots_in_use(self) -> int:
        return sum(1 for s in self._slots if s is not None)

    def parked_bytes(self, tenant: str | None = None) -> int:
        """Bytes of state held in RAM (of one tenant's sessions, or of all)."""
        total = 0
        for session, where in self._where.values():
            if tenant is not None and session.tenant != tenant:
                continue
            total += sum(s.nbytes for s in session.snapshots)
            if isinstance(where, Parked):
                total += where.kv.nbytes
        return total

    def add(self, session: Session, where: Placement | None = None) -> None:
        """Start tracking a session that holds no slot (new: history only)."""
        if isinstance(where, InSlot | Docked):
            raise ValueError("a session enters a slot or dock through the Residency's moves")
        self._where[session.session_id] = (session, where or HistoryOnly())

    def _set(self, session: Session, where: Placement) -> None:
        if isinstance(where, HistoryOnly):
            state = session.state
            state.n_kv = 0
            state.logits = None
            state.window_from = 0
        self._where[session.session_id] = (session, where)

    def table(
        self,
    ) -> tuple[list[Session | None], list[Session | None], list[tuple[str, Session, Placement]]]:
        """The slot and dock tables and every placement, as they are now (for Census.problems)."""
        placements = [(sid, s, where) for sid, (s, where) in self._where.items()]
        return list(self._slots), self.docks.owners(), placements

    def slot_owners(self) -> list[int | None]:
        """Per engine sequence (slots, docks, the scratch), its owner's state length or None:
        what the engine's check compares."""
        owners = [*self._slots, *self.docks.owners()] + [None] * (self.streams.scratch is not None)
        return [s.state.n_kv if s is not None else None for s in owners]
