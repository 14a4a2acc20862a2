"""Where a session's computed state is: one `Placement` value per session, which the
Residency (sessions/residency.py) alone writes.

- `InSlot`: in an engine slot (hot);
- `Docked`: in a dock, a KV stream beside the slots (device memory on a GPU), after eviction
  (warm; engine/streams.py);
- `Parked`: parsed and checked, in RAM (warm), after eviction, a restore or a fork;
- `Stored`: in a checkpoint store (cold): a persistent session's head after a restart or a
  spill, or an ephemeral session's spill (a disk area wiped at every start);
- `HistoryOnly`: only the token history; the next generation evaluates it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkeepd.state import cells as kvstate
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage.checkpoints import CheckpointStore
from kvkeepd.values import Tier


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

TIERS: dict[type, Tier] = {InSlot: "hot", Docked: "warm", Parked: "warm", Stored: "cold", HistoryOnly: "cold"}
