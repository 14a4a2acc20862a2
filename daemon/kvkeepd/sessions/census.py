"""Counting and checking a SessionManager's sessions: the counters that GetInfo and
/metrics show, and the invariant that the registry, the Residency's placements and slots,
the engine's sequences and the catalog agree (checked by the tests, and by the daemon
itself whenever it goes idle under `--check-invariants`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvkeepd.sessions.session import Counters
from kvkeepd.sessions.tenants import Tenant

if TYPE_CHECKING:
    from kvkeepd.sessions.manager import SessionManager


def tenant_counters(m: SessionManager, tenant: Tenant) -> Counters:
    """The counters of one tenant's sessions and requests."""
    mine = m.owned(tenant)
    tiers = [m.residency.tier(s) for s in mine]
    usage = m.residency.usage[tenant.name]
    return Counters(
        sessions=len(mine),
        hot=tiers.count("hot"),
        warm=tiers.count("warm"),
        cold=tiers.count("cold"),
        slots_in_use=tiers.count("hot"),
        tokens_evaluated=usage.tokens_evaluated,
        tokens_generated=usage.tokens_generated,
        tokens_reused=usage.tokens_reused,
        swap_ins=usage.swap_ins,
        swap_in_seconds=usage.swap_in_seconds,
    )


def counters(m: SessionManager) -> Counters:
    """The counters of the whole daemon, as they are now."""
    tiers = [m.residency.tier(s) for s in m.sessions.values() if not s.closed]
    return Counters(
        sessions=len(tiers),
        hot=tiers.count("hot"),
        warm=tiers.count("warm"),
        cold=tiers.count("cold"),
        slots_in_use=m.residency.slots_in_use,
        tokens_evaluated=m.engine.stats_evaluated,
        tokens_generated=m.engine.stats_generated,
        tokens_reused=m.conversations.tokens_reused,
        swap_ins=m.residency.swap_ins,
        swap_in_seconds=m.residency.swap_in_seconds,
        parked_bytes=m.residency.ram_bytes(),
        store_bytes=m.stores.disk.used(),
        journal_records=m.stores.journal.records,
        journal_syncs=m.stores.journal.syncs,
        whole_bytes=m.residency.wholes.nbytes,
        whole_hits=m.residency.wholes.hits,
    )


async def problems(m: SessionManager, deep: bool = True) -> list[str]:
    """Everything that should agree and does not: slot table, placements, the engine's
    sequences, the registry and the catalog. Meaningful when no operation runs: both sides
    are read at that moment (the engine runs its check before any later command)."""
    found = m.residency.problems()
    for sid, s in m.sessions.items():
        if s.closed or s.busy:
            found.append(f"{sid} is {'closed' if s.closed else 'busy'} while registered and idle")
    live = {sid for sid, s in m.sessions.items() if s.persistent} | m.unloaded
    owners = m.residency.slot_owners()
    engine_check = asyncio.wrap_future(m.engine.call(lambda e: e.check(owners, deep)))
    catalog = {sid for sid, _, _ in await asyncio.to_thread(m.durable.catalog.sessions)}
    found += await engine_check
    # A shared catalog holds other daemons' sessions too.
    if catalog != live and not m.ops.running and not m.shared:
        found.append(f"persistent sessions differ from the catalog's: {sorted(catalog ^ live)}")
    return found
