"""The lifecycle flows of a session: create, rewind and close.

Each runs as an operation that finishes once started (ops.py), holding the session's lock
where it changes one; a new session is registered only once it is whole (its system prompt
tokenized, a persistent one's first head saved), and a close's commit point is the catalog
transaction that forgets its head and checkpoints.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import replace

from kvkeepd.errors import ContextFull, InvalidRequest
from kvkeepd.sessions.durability.leases import Leases
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.flows.head_saves import save_or_put_back
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.prompting.tokens import Tokenizer
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant, session_salt
from kvkeepd.values import messages
from kvkeepd.values.generation import check_stop
from kvkeepd.values.messages import ChatMessage
from kvkeepd.values.sampling import MAX_SEED, SamplingOverrides, SamplingParams
from kvkeepd.values.toolcall import Tool, check_tools


class Lifecycle:
    """Creates, rewinds and closes the sessions a SessionHost holds."""

    def __init__(
        self,
        host: SessionHost,
        *,
        n_ctx: int,
        tokens: Tokenizer,
        residency: Residency,
        persistence: Persistence,
        leases: Leases,
    ) -> None:
        """`n_ctx`: a session's context, in tokens."""
        self.host = host
        self.n_ctx = n_ctx
        self.tokens = tokens
        self.residency = residency
        self.persistence = persistence
        self.leases = leases

    async def create(
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
        """A new session; its system prompt is rendered now (with its tools, where the
        template writes them there) and evaluated on first use."""
        policy = messages.context_policy(context_policy)
        params = sampling.apply(SamplingParams())
        if sampling.get("seed") is None:
            params = replace(params, seed=secrets.randbelow(MAX_SEED + 1))
        salt = session_salt(tenant, cache_salt)
        now = self.host.clock()
        session = Session(
            "s_" + secrets.token_hex(12),
            persistent,
            params,
            check_stop(stop),
            now,
            now,
            tenant=tenant.name,
            salt=salt,
            context_policy=policy,
            tools=check_tools(tools),
        )
        return await self.host.ops.run(self._create(tenant, session, system_prompt))

    async def _create(self, tenant: Tenant, session: Session, system_prompt: str) -> Session:
        self.host.check_quota(tenant)
        if system_prompt:
            tokens = await self.tokens.system(system_prompt, session.tools)
            if len(tokens) >= self.n_ctx:
                raise ContextFull(
                    f"the system prompt has {len(tokens)} tokens; the session's context holds {self.n_ctx}"
                )
            session.state.tokens = tokens
            session.system_end = len(tokens)
            session.messages.append(ChatMessage("system", system_prompt, 0))
        self.residency.add(session)
        if session.persistent:
            try:
                await self.persistence.check_disk()
                await self.persistence.check_stored(tenant)
                await self.residency.save_head(session)
            except BaseException:
                await self.residency.forget(session)
                await self.leases.release(session.session_id)
                raise
        self.host.register(session)
        return session

    async def close(self, session_id: str, tenant: Tenant) -> None:
        """Stop the session's generation if any, forget its head and checkpoints, free its
        state. All or nothing: the catalog transaction is the commit point."""
        session = await self.host.find(session_id, tenant)
        await self.host.ops.run(self.close_session(session))

    async def close_session(self, session: Session) -> None:
        """Close a session already found (`close`, and expiry: see expiry.py)."""
        if session.job is not None:
            session.job.cancelled = True
        async with self.host.use(session):
            await self.persistence.delete_session(session)
            self.residency.wholes.drop_session(session.session_id)
            session.closed = True
            self.host.unregister(session)
            await self.residency.forget(session)

    async def rewind(self, session_id: str, tenant: Tenant, n_tokens: int) -> Session:
        """Keep the first n_tokens tokens of history; the session continues from there."""
        session = await self.host.find(session_id, tenant)
        return await self.host.ops.run(self._rewind(session, n_tokens))

    async def _rewind(self, session: Session, n_tokens: int) -> Session:
        async with self.host.use(session):
            if not 0 <= n_tokens <= len(session.state.tokens):
                raise InvalidRequest(f"n_tokens must be in [0, {len(session.state.tokens)}], got {n_tokens}")
            before = session.before()
            await self.residency.truncate(session, n_tokens)
            session.messages = [m for m in session.messages if m.start < n_tokens]
            self.host.touch(session)
            if session.persistent:
                # Whole or nothing: the cells the cut kept are the start of the history put back.
                await save_or_put_back(self.residency, session, before, cells=True)
        return session
