"""The stores a daemon keeps state in, as one value handed to the session layer."""

from __future__ import annotations

from dataclasses import dataclass

from kvkeepd.storage.budget import DiskBudget
from kvkeepd.storage.checkpoints import CheckpointStore
from kvkeepd.storage.journal import TurnJournal


@dataclass(frozen=True)
class Stores:
    """durable: persistent sessions and imports (disk); volatile: ephemeral sessions'
    checkpoints (RAM); spill: ephemeral sessions' state under memory pressure (disk, wiped
    at start); disk: the budget durable, spill and journal writes share; journal:
    persistent sessions' turns since their heads."""

    durable: CheckpointStore
    volatile: CheckpointStore
    spill: CheckpointStore
    disk: DiskBudget
    journal: TurnJournal
