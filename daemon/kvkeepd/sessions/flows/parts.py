"""The parts a SessionManager is made of, built from its collaborators and wired to each
other: one place that says which part gets which."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvkeepd.config.settings import Settings
from kvkeepd.engine.engine import Engine
from kvkeepd.engine.structured_output import Grammars
from kvkeepd.sessions.durability.leases import Leases
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.flows.census import Census
from kvkeepd.sessions.flows.checkpointing import Checkpointing
from kvkeepd.sessions.flows.expiry import Sweeper
from kvkeepd.sessions.flows.generation import Conversations
from kvkeepd.sessions.flows.handover import Handover
from kvkeepd.sessions.flows.kept_prefixes import KeptPrefixes
from kvkeepd.sessions.flows.lifecycle import Lifecycle
from kvkeepd.sessions.flows.responses import Responses
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.ledger import Ledger
from kvkeepd.sessions.memory.prefix_cache import PrefixCache
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.prompting.templates import ChatTemplate
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenants
from kvkeepd.storage.stores import Stores


@dataclass(frozen=True)
class Parts:
    """What counts (ledger), which daemon holds a shared session (leases), how sessions
    survive (persistence), where their state lives (residency), and the flows."""

    ledger: Ledger
    leases: Leases
    persistence: Persistence
    residency: Residency
    conversations: Conversations
    checkpointing: Checkpointing
    handover: Handover
    lifecycle: Lifecycle
    responses: Responses
    prefixes: KeptPrefixes
    sweeper: Sweeper
    census: Census


def build_parts(
    host: SessionHost,
    engine: Engine,
    settings: Settings,
    stores: Stores,
    template: ChatTemplate | None,
    tenants: Tenants,
) -> Parts:
    """The parts of the registry `host`, over the started engine, the stores, the model's
    chat template (None: it has none) and the tenants."""
    assert engine.info is not None
    model = engine.info
    ledger = Ledger()
    leases = Leases(stores.durable.catalog, settings.lease_seconds, settings.lease_wait, settings.daemon_name)
    # The host's clock, read at each use: tests replace it to drive expiry.
    persistence = Persistence(stores, settings, lambda: host.clock(), leases)
    residency = Residency(engine, settings, stores, persistence, tenants, ledger)
    prefixes = PrefixCache(settings, model, engine, stores, residency, live=lambda: host.sessions.values())
    grammars = Grammars(
        # Reads the vocabulary only: built in a worker thread, beside the engine's steps.
        lambda: asyncio.to_thread(engine.read_vocab, lambda c: c.grammar_tokenizer()),
        model.n_vocab,
    )
    conversations = Conversations(
        host,
        settings=settings,
        model=model,
        engine=engine,
        residency=residency,
        persistence=persistence,
        prefixes=prefixes,
        grammars=grammars,
        tenants=tenants,
        template=template,
        ledger=ledger,
    )
    checkpointing = Checkpointing(
        host, settings=settings, model=model, residency=residency, persistence=persistence
    )
    handover = Handover(
        host, leases=leases, persistence=persistence, residency=residency, restored=Session.of_head
    )
    lifecycle = Lifecycle(
        host,
        n_ctx=model.n_ctx_seq,
        tokens=conversations.tokens,
        residency=residency,
        persistence=persistence,
        leases=leases,
    )
    responses = Responses(
        host,
        settings=settings,
        residency=residency,
        persistence=persistence,
        lifecycle=lifecycle,
        checkpointing=checkpointing,
        conversations=conversations,
        template=template,
        ledger=ledger,
    )
    kept = KeptPrefixes(
        host,
        settings=settings,
        model=model,
        tokens=conversations.tokens,
        residency=residency,
        persistence=persistence,
    )
    sweeper = Sweeper(
        host, settings, residency, stores, leases, lifecycle.close_session, responses.expire, kept.expire
    )
    census = Census(host, ledger=ledger, residency=residency, engine=engine, stores=stores)
    return Parts(
        ledger=ledger,
        leases=leases,
        persistence=persistence,
        residency=residency,
        conversations=conversations,
        checkpointing=checkpointing,
        handover=handover,
        lifecycle=lifecycle,
        responses=responses,
        prefixes=kept,
        sweeper=sweeper,
        census=census,
    )
