"""Ledger: the running counts of what requests cost, daemon-wide and per tenant, written in
one place; and the counters GetInfo and the metrics report.

The flows that count are given the manager's one Ledger and call it as things happen (a turn
ends, a state is swapped into a slot, a stored response is resumed); the Census reads it.
Nothing else keeps a count of these, so no module writes another's table.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Tally:
    """What requests cost: tokens by what happened to them, and states swapped into a slot
    (how many, and the seconds it took)."""

    tokens_evaluated: int = 0
    tokens_generated: int = 0
    tokens_reused: int = 0
    swap_ins: int = 0
    swap_in_seconds: float = 0.0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            tokens_evaluated=self.tokens_evaluated + other.tokens_evaluated,
            tokens_generated=self.tokens_generated + other.tokens_generated,
            tokens_reused=self.tokens_reused + other.tokens_reused,
            swap_ins=self.swap_ins + other.swap_ins,
            swap_in_seconds=self.swap_in_seconds + other.swap_in_seconds,
        )


class Ledger:
    """The daemon's tally and each tenant's, and the stored responses resumed, by where their
    state came from."""

    def __init__(self) -> None:
        self._total = Tally()
        # Per tenant, for GetInfo: each sees its own.
        self._tenants: defaultdict[str, Tally] = defaultdict(Tally)
        self._resumes: Counter[str] = Counter()

    def turn(self, tenant: str, *, evaluated: int, generated: int, reused: int) -> None:
        """A turn of the tenant's ended, having evaluated, generated and reused these tokens."""
        self._add(tenant, Tally(tokens_evaluated=evaluated, tokens_generated=generated, tokens_reused=reused))

    def swap_in(self, tenant: str, seconds: float) -> None:
        """A state of the tenant's was loaded into a slot, taking `seconds`."""
        self._add(tenant, Tally(swap_ins=1, swap_in_seconds=seconds))

    def resumed(self, source: str) -> None:
        """A stored response was resumed, its state found in `source` (responses.SOURCES)."""
        self._resumes[source] += 1

    def _add(self, tenant: str, cost: Tally) -> None:
        self._total += cost
        self._tenants[tenant] += cost

    @property
    def total(self) -> Tally:
        """The daemon's tally: every turn and swap-in. (The engine counts the tokens it
        evaluates and generates outside turns too, a restore that evaluates again: the
        daemon's counters report its counts of those.)"""
        return self._total

    def tenant(self, name: str) -> Tally:
        """The tenant's tally: its turns and swap-ins."""
        return self._tenants[name]

    @property
    def resumes(self) -> Mapping[str, int]:
        """Stored responses resumed so far, by where their state came from."""
        return self._resumes


@dataclass(frozen=True)
class Counters:
    """What GetInfo and the metrics report; a snapshot, safe to read from any thread."""

    sessions: int = 0
    hot: int = 0
    warm: int = 0
    cold: int = 0
    slots_in_use: int = 0
    # Warm sessions whose KV waits in a dock (device memory on a GPU), not in RAM.
    docked: int = 0
    tally: Tally = Tally()
    parked_bytes: int = 0
    store_bytes: int = 0
    # Persistent turns made durable in the journal, and the syncs that did it (group commit:
    # fewer syncs than records when turns end together).
    journal_records: int = 0
    journal_syncs: int = 0
    # Whole states of ephemeral checkpoints kept in the RAM budget's free room, and the
    # restores and forks that loaded one (sessions/whole_states.py).
    whole_bytes: int = 0
    whole_hits: int = 0
    # Stored responses resumed, by where their state came from (sessions/flows/responses.py).
    response_resumes: tuple[tuple[str, int], ...] = ()
