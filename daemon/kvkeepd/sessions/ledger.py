"""Ledger: the running counts of what requests cost, daemon-wide and per tenant, written in
one place.

The flows that count are given the manager's one Ledger and call it as things happen (a turn
ends, a state is swapped into a slot, a stored response is resumed); the Census reads it.
Nothing else keeps a count of these, so no module writes another's table.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping

from kvkeepd.sessions.session import TenantUsage


class Ledger:
    """Tokens each tenant's turns evaluated, generated and reused from the prefix cache;
    states swapped into a slot (how many, how long); stored responses resumed, by where
    their state came from. Daemon-wide, tokens evaluated and generated are the engine's
    own counts (it counts work outside turns too: a restore that evaluates again)."""

    def __init__(self) -> None:
        self.tokens_reused = 0
        self.swap_ins = 0
        self.swap_in_seconds = 0.0
        self._resumes: Counter[str] = Counter()
        # Per tenant, for GetInfo: each sees its own.
        self._tenants: defaultdict[str, TenantUsage] = defaultdict(TenantUsage)

    def turn(self, tenant: str, *, evaluated: int, generated: int, reused: int) -> None:
        """A turn of the tenant's ended, having evaluated, generated and reused these tokens."""
        self.tokens_reused += reused
        usage = self._tenants[tenant]
        usage.tokens_reused += reused
        usage.tokens_evaluated += evaluated
        usage.tokens_generated += generated

    def swap_in(self, tenant: str, seconds: float) -> None:
        """A state of the tenant's was loaded into a slot, taking `seconds`."""
        self.swap_ins += 1
        self.swap_in_seconds += seconds
        usage = self._tenants[tenant]
        usage.swap_ins += 1
        usage.swap_in_seconds += seconds

    def resumed(self, source: str) -> None:
        """A stored response was resumed, its state found in `source` (responses.SOURCES)."""
        self._resumes[source] += 1

    @property
    def resumes(self) -> Mapping[str, int]:
        """Stored responses resumed so far, by where their state came from."""
        return self._resumes

    def tenant(self, name: str) -> TenantUsage:
        """What the tenant's requests cost so far."""
        return self._tenants[name]
