"""SessionManager: the registry of sessions and the flows of the RPCs that act on them.

Every flow runs as an operation that finishes once started (ops.py): a client that gives
up stops waiting, not the work. One operation at a time acts on a session (its lock); a
second one waits its turn. Where a session's state lives is the Residency's (sessions/memory/residency.py);
saving and finding checkpoints is the Persistence's; taking sessions over from a shared
catalog and handing them to other daemons is the Handover's (handover.py); the flows of
generation and of checkpoints are in generation.py and checkpointing.py; expiry and the
budgets' sweeps in expiry.py; the counters and the invariant in census.py. Which part gets
which collaborator is flows/parts.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from kvkeepd.config.settings import Settings
from kvkeepd.engine.context import ModelInfo
from kvkeepd.engine.engine import Engine
from kvkeepd.errors import (
    Busy,
    InvalidRequest,
    KvkeepError,
    NoChatTemplate,
    NotFound,
    SessionElsewhere,
)
from kvkeepd.sessions import ops as opsmod
from kvkeepd.sessions.flows.parts import build_parts
from kvkeepd.sessions.flows.response_list import PAGE, ResponsePage, list_responses
from kvkeepd.sessions.flows.responses import Describe, ResponseRecord, ResponseRequest
from kvkeepd.sessions.ledger import Counters
from kvkeepd.sessions.placement import Tier, store_location
from kvkeepd.sessions.prompting.templates import ChatTemplate
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant, Tenants
from kvkeepd.storage.catalog import CheckpointRow, ListedSession
from kvkeepd.storage.stores import Stores
from kvkeepd.values.generation import Chunk, Turn
from kvkeepd.values.messages import ChatMessage, Message, check_messages
from kvkeepd.values.sampling import SamplingOverrides
from kvkeepd.values.toolcall import Tool, check_tools

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"^s_[0-9a-f]{24}$")
#: With a shared catalog, the most persistent sessions a listing reports from it (the most
#: recently used: ListSessions has no paging).
LISTED_FROM_CATALOG = 1000


@dataclass(frozen=True)
class SessionView:
    """What the RPCs report of a session."""

    session: Session
    n_tokens: int
    tier: Tier
    location: str  # where its state is now (placement.py's `location`)
    expires_at: float  # when it expires idle at the earliest; 0: never
    n_checkpoints: int
    holder: str = ""  # with a shared catalog: this daemon's name


class SessionManager:
    """Owns every session: the registry, and the composition of the flows that act on them.
    Built with the started engine, the settings, the checkpoint stores, the model's chat
    template (None: it has none), the tenants and a clock (tests inject one to drive expiry).
    It is the flows' SessionHost (sessions/host.py)."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        stores: Stores,
        template: ChatTemplate | None,
        tenants: Tenants,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if engine.info is None:
            raise ValueError("the engine must be started before the session manager")
        self.engine = engine
        self.model: ModelInfo = engine.info
        self.settings = settings
        self.stores = stores
        self.durable = stores.durable
        self.template = template
        # Who may call, and their quotas (the auth file's; SIGHUP replaces them in place).
        self.tenants = tenants
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.ops = opsmod.Ops(on_idle=self._on_idle)
        parts = build_parts(self, engine, settings, stores, template, tenants)
        self.ledger, self.leases, self.persistence = parts.ledger, parts.leases, parts.persistence
        self.residency, self._census, self._sweeper = parts.residency, parts.census, parts.sweeper
        self._conversations, self._checkpointing = parts.conversations, parts.checkpointing
        self._handover, self._lifecycle, self._responses = parts.handover, parts.lifecycle, parts.responses
        self._prefixes = parts.prefixes
        self.counters = Counters()
        self.invariant_violations = 0
        self._warming: asyncio.Task[None] | None = None
        # A shared catalog: sessions are found in it on demand, one lookup at a time.
        self.shared = self.durable.catalog.shared

    async def start(self) -> None:
        """Finish set-up: persistent sessions from disk (with a shared catalog, the leases'
        renewal instead: other daemons' sessions are theirs until asked for); the grammars'
        vocabulary built beside it."""
        self._warming = asyncio.get_running_loop().create_task(self._conversations.grammars.warm())
        if self.shared:
            self._handover.start()
            self.publish()
            return
        loaded = await asyncio.to_thread(self.persistence.load_persistent, Session.of_head)
        for session, where in loaded:
            self.residency.add(session, where)
            self.sessions[session.session_id] = session
        known = {s.session_id for s, _ in loaded}
        sessions = await asyncio.to_thread(self.durable.catalog.sessions)
        self._census.unloaded.update(sid for sid, _, _ in sessions if sid not in known)
        # Sessions that continue from a journal record are the ones with turns since their head.
        replayed = {s.session_id for s, _ in loaded if s.dirty}
        self.persistence.drop_stale_records(replayed, {sid for sid, _, _ in sessions})
        if loaded:
            log.info("loaded %d persistent sessions", len(loaded))
        self.publish()

    async def shutdown(self) -> None:
        """Let running operations end, then save every persistent session that changed."""
        if self._warming is not None:
            self._warming.cancel()
        if not await self.ops.settle(self.settings.grace_seconds + 5):
            log.warning("%d operations still running at shutdown", self.ops.running)
        for session in list(self.sessions.values()):
            if session.persistent and session.dirty and not session.closed:
                try:
                    await self.ops.run(self._save(session))
                except KvkeepError as e:
                    log.error("session %s was not saved at shutdown: %s", session.session_id, e)
        await self._handover.stop()

    async def _save(self, session: Session) -> None:
        async with self.use(session):
            await self.residency.save_head(session)

    @contextlib.asynccontextmanager
    async def use(self, session: Session) -> AsyncIterator[None]:
        """Hold a session's lock (waiting for it may be cut short), and check it is open."""
        async with opsmod.current().waiting():
            await session.lock.acquire()
        try:
            if session.closed:
                raise self._gone(session)
            yield
        finally:
            session.lock.release()
            # The session may now give its slot up to a request waiting for one.
            self.residency.slot_freed()
            self.publish()

    @staticmethod
    def _gone(session: Session) -> KvkeepError:
        if session.moved:
            return SessionElsewhere(f"session {session.session_id} moved to another daemon; retry", 100)
        return NotFound(f"no session {session.session_id}")

    # ---- registry ----------------------------------------------------------------------------

    def get(self, session_id: str, tenant: Tenant) -> Session:
        """The tenant's open session with this id; InvalidRequest if malformed, NotFound if
        unknown, closed or another tenant's (the same answer, by the same path)."""
        if not _SESSION_ID.match(session_id):
            raise InvalidRequest(f"malformed session id: {session_id[:80]!r}")
        session = self.sessions.get(session_id)
        if session is None or session.closed or session.tenant != tenant.name:
            raise NotFound(f"no session {session_id}")
        return session

    async def find(self, session_id: str, tenant: Tenant) -> Session:
        """The tenant's session, as `get` finds it; with a shared catalog, a persistent
        session this daemon does not hold is looked up there and taken over (its lease
        first, then its head): SessionElsewhere while another daemon holds it."""
        try:
            return self.get(session_id, tenant)
        except NotFound:
            if not self.shared:
                raise
        return await self.ops.run(self._handover.take_over(session_id, tenant))

    async def view(self, session: Session) -> SessionView:
        """The session as the RPCs report it; NotFound if it was closed meanwhile, and
        SessionElsewhere if it was handed over or dropped to another daemon meanwhile."""
        views = await self.views([session])
        if not views:
            raise self._gone(session)
        return views[0]

    async def views(self, sessions: Sequence[Session]) -> list[SessionView]:
        """Sessions as the RPCs report them (those still registered)."""
        ids = [s.session_id for s in sessions]

        def counts() -> dict[str, int]:
            out = self.durable.catalog.counts(ids)
            out.update(self.stores.volatile.catalog.counts(ids))
            return out

        n = await asyncio.to_thread(counts)
        holder = self.leases.name if self.shared else ""
        return [
            SessionView(
                s,
                len(s.state.tokens),
                self.residency.tier(s),
                self.residency.location(s),
                self.expires_at(s.persistent, s.last_used_at),
                n.get(s.session_id, 0),
                holder,
            )
            for s in sessions
            if s.session_id in self.sessions
        ]

    def expires_at(self, persistent: bool, last_used_at: float) -> float:
        """When a session idle since `last_used_at` is closed (ephemeral) or deleted
        (persistent) at the earliest, by --idle-ttl or --persistent-ttl; 0: never."""
        ttl = self.settings.persistent_ttl if persistent else self.settings.idle_ttl
        return last_used_at + ttl if ttl > 0 else 0.0

    def store_location(self, persistent: bool) -> str:
        """Where the checkpoints of persistent (or ephemeral) sessions are kept, and the heads
        of the persistent sessions this daemon does not hold: "disk", "shared store" or "ram"."""
        return store_location(self.durable if persistent else self.stores.volatile)

    async def listing(self, tenant: Tenant) -> tuple[list[SessionView], list[ListedSession]]:
        """The tenant's sessions as ListSessions reports them: those this daemon holds (as
        they are now) and, with a shared catalog, its persistent sessions that another daemon
        holds or none does (as the catalog has them: their heads)."""
        views = await self.views(self.owned(tenant))
        if not self.shared:
            return views, []
        rows = await asyncio.to_thread(self.durable.catalog.tenant_sessions, tenant.name, LISTED_FROM_CATALOG)
        here = {v.session.session_id for v in views}
        return views, [r for r in rows if r.session_id not in here]

    def owned(self, tenant: Tenant) -> list[Session]:
        """The tenant's open sessions, oldest first."""
        mine = [s for s in self.sessions.values() if s.tenant == tenant.name and not s.closed]
        return sorted(mine, key=lambda s: s.created_at)

    def check_quota(self, tenant: Tenant) -> None:
        """Busy when the tenant holds as many sessions as its quota allows."""
        limit = tenant.quota.max_sessions
        if limit and len(self.owned(tenant)) >= limit:
            raise Busy(f"the tenant's quota of {limit} sessions is reached: close one first")

    def touch(self, session: Session) -> None:
        session.last_used_at = self.clock()
        session.dirty = True

    def register(self, session: Session) -> None:
        """A session the Residency tracks becomes one the requests find."""
        self.sessions[session.session_id] = session
        self.publish()

    def unregister(self, session: Session) -> None:
        """The session is no longer found (closed, or let go to another daemon)."""
        self.sessions.pop(session.session_id, None)

    # ---- what the doors call: every RPC and route is one of these --------------------------

    def resolve_tenant(self, authorization: str | None) -> Tenant:
        """The caller's tenant from its Authorization value; Unauthenticated if it names none."""
        return self.tenants.resolve(authorization)

    def replace_tenants(self, tenants: Tenants) -> None:
        """Serve the auth file's new tenants and quotas from now on (SIGHUP)."""
        self.tenants.replace_with(tenants)

    @property
    def catalog_reachable(self) -> bool:
        """Whether the shared catalog answered the last lease renewal."""
        return self.leases.reachable

    async def run_expiry(self) -> None:
        """Expire sessions, checkpoints and responses by age and budget until cancelled."""
        await self._sweeper.run()

    async def expire_now(self) -> None:
        """One pass of expiry now: idle sessions, and RAM and disk brought within budget."""
        await self._sweeper.sweep()

    async def create_session(
        self,
        tenant: Tenant,
        system_prompt: str,
        sampling: SamplingOverrides,
        stop: Sequence[str],
        persistent: bool,
        cache_salt: bytes = b"",
        context_policy: str = "",
        tools: Sequence[Tool] = (),
    ) -> Session:
        """A new session of the tenant's (Lifecycle.create)."""
        return await self._lifecycle.create(
            tenant, system_prompt, sampling, stop, persistent, cache_salt, context_policy, tools
        )

    async def close_session(self, session_id: str, tenant: Tenant) -> None:
        """Close the session and forget its state (Lifecycle.close)."""
        await self._lifecycle.close(session_id, tenant)

    async def rewind(self, session_id: str, tenant: Tenant, n_tokens: int) -> Session:
        """Drop the session's last `n_tokens` (Lifecycle.rewind)."""
        return await self._lifecycle.rewind(session_id, tenant, n_tokens)

    async def checkpoint(self, session_id: str, tenant: Tenant, label: str) -> CheckpointRow:
        """Checkpoint the session as it is now (Checkpointing.checkpoint)."""
        return await self._checkpointing.checkpoint(session_id, tenant, label)

    async def list_checkpoints(self, session_id: str, tenant: Tenant) -> list[CheckpointRow]:
        """The session's checkpoints, oldest first."""
        return await self._checkpointing.list_checkpoints(session_id, tenant)

    async def checkpoint_messages(self, checkpoint_id: str, tenant: Tenant) -> list[ChatMessage]:
        """The conversation one of the tenant's checkpoints holds (its manifest's messages)."""
        store = await self.persistence.find(checkpoint_id, tenant)
        snap = await asyncio.to_thread(store.snapshot, checkpoint_id)
        return snap.messages

    async def restore(self, session_id: str, checkpoint_id: str, tenant: Tenant) -> tuple[Session, bool]:
        """Put the session back to a checkpoint; True with it if it was evaluated again."""
        return await self._checkpointing.restore(session_id, checkpoint_id, tenant)

    async def fork(
        self, session_id: str, checkpoint_id: str, persistent: bool, tenant: Tenant
    ) -> tuple[Session, bool]:
        """A new session from the session's state or one of its checkpoints."""
        return await self._checkpointing.fork(session_id, checkpoint_id, persistent, tenant)

    async def delete_checkpoint(self, checkpoint_id: str, tenant: Tenant) -> None:
        """Delete one of the tenant's checkpoints."""
        await self._checkpointing.delete_checkpoint(checkpoint_id, tenant)

    def export_checkpoint(self, checkpoint_id: str, tenant: Tenant) -> AsyncIterator[bytes]:
        """The checkpoint as an export file, in chunks (storage/exports.py)."""
        return self._checkpointing.export_checkpoint(checkpoint_id, tenant)

    async def import_checkpoint(self, chunks: AsyncIterator[bytes], tenant: Tenant) -> CheckpointRow:
        """A checkpoint of the tenant's from an export file's chunks."""
        return await self._checkpointing.import_checkpoint(chunks, tenant)

    def answer(self, tenant: Tenant, request: ResponseRequest, describe: Describe) -> AsyncIterator[Chunk]:
        """A response to `request`, streamed, and stored when it asks (Responses.answer)."""
        return self._responses.answer(tenant, request, describe)

    async def lookup_response(self, response_id: str, tenant: Tenant) -> ResponseRecord:
        """The tenant's stored response with this id; NotFound otherwise."""
        return await self._responses.lookup(response_id, tenant)

    async def delete_response(self, response_id: str, tenant: Tenant) -> None:
        """Delete the tenant's stored response, freeing what it held against the quota."""
        await self._responses.delete(response_id, tenant)

    async def list_responses(
        self, tenant: Tenant, *, after: str = "", limit: int = PAGE, order: str = "desc"
    ) -> ResponsePage:
        """A page of the tenant's stored responses (flows/response_list.py)."""
        return await list_responses(self._responses, tenant, after=after, limit=limit, order=order)

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self,
        session_id: str,
        tenant: Tenant,
        *,
        prompt: str,
        prompt_token_ids: Sequence[int],
        parse_special: bool,
        turn: Turn,
    ) -> AsyncIterator[Chunk]:
        """Extend the session by a prompt (text or token ids) and stream the continuation."""
        session = await self.find(session_id, tenant)
        stream: AsyncIterator[Chunk] = self.ops.stream(
            lambda put: self._conversations.generate(
                session,
                put,
                prompt=prompt,
                prompt_token_ids=prompt_token_ids,
                parse_special=parse_special,
                turn=turn,
            )
        )
        async for chunk in stream:
            yield chunk

    async def chat(
        self, session_id: str, tenant: Tenant, *, message: str, turn: Turn
    ) -> AsyncIterator[Chunk]:
        """Add a user message through the chat template and stream the assistant's reply."""
        if self.template is None:
            self.get(session_id, tenant)  # an unknown session is NotFound first
            raise NoChatTemplate("the model has no chat template; use Generate")
        session = await self.find(session_id, tenant)
        stream: AsyncIterator[Chunk] = self.ops.stream(
            lambda put: self._conversations.chat(session, put, message=message, turn=turn)
        )
        async for chunk in stream:
            yield chunk

    async def converse(
        self, session_id: str, tenant: Tenant, *, messages: Sequence[Message], whole: bool, turn: Turn
    ) -> AsyncIterator[Chunk]:
        """Add messages of any roles through the chat template and stream the assistant's
        reply; with `whole`, the messages are the whole conversation and the session keeps
        what of its history matches them."""
        if self.template is None:
            self.get(session_id, tenant)
            raise NoChatTemplate("the model has no chat template; use Generate")
        session = await self.find(session_id, tenant)
        stream: AsyncIterator[Chunk] = self.ops.stream(
            lambda put: self._conversations.converse(session, put, messages=messages, whole=whole, turn=turn)
        )
        async for chunk in stream:
            yield chunk

    async def keep_prefixes(
        self, session_id: str, tenant: Tenant, prefixes: Sequence[Sequence[Message]], ttl: float
    ) -> int:
        """Keep the session's state at the end of each prefix of its conversation for `ttl`
        seconds at least, where later prompts find it (KeptPrefixes.keep); the tokens of the
        longest newly stored."""
        return await self._prefixes.keep(session_id, tenant, prefixes, ttl)

    async def count_tokens(self, messages: Sequence[Message], tools: Sequence[Tool]) -> int:
        """The tokens of a whole conversation, with the tools it may call, as the chat
        template renders it for the assistant's reply (a new session's first turn)."""
        if self.template is None:
            raise NoChatTemplate("the model has no chat template")
        tokens = self._conversations.tokens
        check_messages(messages)
        for m in messages:
            tokens.check_bytes(m.content, "message")
        segments = await tokens.render(messages, True, check_tools(tools))
        return len(await tokens.segments(segments, first=True))

    # ---- counters, invariants (census.py) ---------------------------------------------

    def tenant_counters(self, tenant: Tenant) -> Counters:
        """The counters of one tenant's sessions and requests (GetInfo shows a caller its own)."""
        return self._census.tenant_counters(tenant)

    def publish(self) -> Counters:
        """Recompute the counters; the metrics thread reads the last value published."""
        self.counters = self._census.counters()
        return self.counters

    async def check_invariant(self, deep: bool = True) -> list[str]:
        """Everything that should agree and does not (Census.problems). Meaningful when no
        operation runs."""
        return await self._census.problems(deep)

    async def settle(self) -> None:
        """Wait until no operation runs (tests, before an invariant check)."""
        await self.ops.settle()

    def _on_idle(self) -> None:
        if self.settings.check_invariants:
            asyncio.get_running_loop().create_task(self._debug_check())

    async def _debug_check(self) -> None:
        if self.ops.running:
            return
        # Positions only: parsing every slot's state whenever the daemon goes idle costs
        # more than the requests it follows.
        for problem in await self.check_invariant(deep=False):
            self.invariant_violations += 1
            log.error("invariant violated: %s", problem)
