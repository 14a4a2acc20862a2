"""Counting and checking the registered sessions: the counters that GetInfo and /metrics
show, and the invariant that the registry, the Residency's placements and slots, the
engine's sequences and the catalog agree (checked by the tests, and by the daemon itself
whenever it goes idle under `--check-invariants`).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from kvkeepd.engine.engine import Engine
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.ledger import Counters, Ledger
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.placement import Docked, HistoryOnly, InSlot, Parked, Placement, Stored
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.storage.stores import Stores


class Census:
    """Counts what the sessions, the residency, the engine and the stores hold, and what the
    ledger counted."""

    def __init__(
        self, host: SessionHost, *, ledger: Ledger, residency: Residency, engine: Engine, stores: Stores
    ) -> None:
        self.host = host
        self.ledger = ledger
        self.residency = residency
        self.engine = engine
        self.stores = stores
        # Persistent sessions of the catalog that were not loaded at start (`problems`): the
        # host adds them as it starts.
        self.unloaded: set[str] = set()

    def tenant_counters(self, tenant: Tenant) -> Counters:
        """The counters of one tenant's sessions and requests."""
        tiers = [
            self.residency.tier(s)
            for s in self.host.sessions.values()
            if s.tenant == tenant.name and not s.closed
        ]
        docked = sum(1 for s in self.residency.docks.owners() if s is not None and s.tenant == tenant.name)
        return Counters(
            sessions=len(tiers),
            docked=docked,
            hot=tiers.count("hot"),
            warm=tiers.count("warm"),
            cold=tiers.count("cold"),
            slots_in_use=tiers.count("hot"),
            tally=self.ledger.tenant(tenant.name),
        )

    def counters(self) -> Counters:
        """The counters of the whole daemon, as they are now."""
        residency = self.residency
        tiers = [residency.tier(s) for s in self.host.sessions.values() if not s.closed]
        return Counters(
            sessions=len(tiers),
            docked=sum(1 for s in residency.docks.owners() if s is not None),
            hot=tiers.count("hot"),
            warm=tiers.count("warm"),
            cold=tiers.count("cold"),
            slots_in_use=residency.slots_in_use,
            tally=replace(
                self.ledger.total,
                tokens_evaluated=self.engine.stats_evaluated,
                tokens_generated=self.engine.stats_generated,
            ),
            parked_bytes=residency.ram_bytes(),
            store_bytes=self.stores.disk.used(),
            journal_records=self.stores.journal.records,
            journal_syncs=self.stores.journal.syncs,
            whole_bytes=residency.wholes.nbytes,
            whole_hits=residency.wholes.hits,
            response_resumes=tuple(sorted(self.ledger.resumes.items())),
        )

    async def problems(self, deep: bool = True) -> list[str]:
        """Everything that should agree and does not: slot table, placements, the engine's
        sequences, the registry and the catalog. Meaningful when no operation runs: both
        sides are read at that moment (the engine runs its check before any later command)."""
        found = placement_problems(*self.residency.table())
        sessions = self.host.sessions
        for sid, s in sessions.items():
            if s.closed or s.busy:
                found.append(f"{sid} is {'closed' if s.closed else 'busy'} while registered and idle")
        live = {sid for sid, s in sessions.items() if s.persistent} | self.unloaded
        owners = self.residency.slot_owners()
        engine_check = asyncio.wrap_future(self.engine.call(lambda e: e.check(owners, deep)))
        catalog = self.stores.durable.catalog
        listed = {sid for sid, _, _ in await asyncio.to_thread(catalog.sessions)}
        found += await engine_check
        # A shared catalog holds other daemons' sessions too.
        if listed != live and not self.host.ops.running and not catalog.shared:
            found.append(f"persistent sessions differ from the catalog's: {sorted(listed ^ live)}")
        return found


def placement_problems(
    slots: list[Session | None], docks: list[Session | None], placements: list[tuple[str, Session, Placement]]
) -> list[str]:
    """Where the slot and dock tables and the placements disagree (empty when they agree)."""
    out = []
    where_of = {sid: where for sid, _, where in placements}
    for i, owner in enumerate(slots):
        if owner is not None and where_of.get(owner.session_id) != InSlot(i):
            out.append(f"slot {i} is held by {owner.session_id}, which is not placed there")
    for i, owner in enumerate(docks):
        if owner is not None and where_of.get(owner.session_id) != Docked(i):
            out.append(f"dock {i} is held by {owner.session_id}, which is not placed there")
    for sid, session, where in placements:
        state = session.state
        if state.n_kv > len(state.tokens):
            out.append(f"{sid}: state covers {state.n_kv} of {len(state.tokens)} tokens")
        match where:
            case InSlot(slot):
                if slots[slot] is not session:
                    out.append(f"{sid} is placed in slot {slot}, which another holds")
            case Docked(place):
                if docks[place] is not session:
                    out.append(f"{sid} is placed in dock {place}, which another holds")
            case Parked(kv):
                if kv.n != state.n_kv:
                    out.append(f"{sid}: parked state covers {kv.n} tokens, the session {state.n_kv}")
            case Stored(_, _, snap):
                if snap.n_kv != state.n_kv:
                    out.append(f"{sid}: stored state covers {snap.n_kv} tokens, the session {state.n_kv}")
            case HistoryOnly():
                if state.n_kv:
                    out.append(f"{sid} is history-only but claims {state.n_kv} tokens of state")
    return out
