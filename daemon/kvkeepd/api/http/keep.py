"""The sessions the HTTP door keeps between requests that name no session.

A plain OpenAI client resends the whole conversation every turn. The door answers each such
request in one of its own ephemeral sessions and keeps the most recent ones open, per
tenant: the next request whose messages begin with a kept session's continues that session
(only the new messages are evaluated), and any other one starts a new session that the
prefix cache can attach blocks to from the kept ones (a closed ephemeral session leaves
nothing in the cache). A client that names its conversation (`prompt_cache_key`, on
chat completions and the Responses API) is answered only in sessions kept under that key:
two conversations of one tenant with the same beginning do not take each other's session.
A request that gives a cache salt is answered only in sessions made with that salt, and one
that gives none only in sessions made without: a kept session is never continued under
another salt than its own.
A session whose last turn was left before its reply ended (its client hung up) is matched
by the messages it held before that turn, so the client's retry or next turn continues it.
Nobody else is given their ids, so the door owns them: it closes the oldest beyond
`PER_TENANT`, and the sweeper's idle expiry closes the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

from kvkeepd.errors import InvalidRequest, KvkeepError
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant, session_salt
from kvkeepd.values.generation import Chunk, Turn
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides

log = logging.getLogger(__name__)

# Sessions kept per tenant: a few conversations in flight at once, each one parked in RAM
# (or spilled to disk) when not in a slot, within --ram-cache like any other session.
PER_TENANT = 8


class SessionKeep:
    """Owns the door's kept sessions; used from the event loop only."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager
        self._kept: dict[str, OrderedDict[str, Session]] = {}
        # The key each kept session was made under ("": none), by its id.
        self._keys: dict[str, str] = {}
        # Kept sessions whose last turn ended before its reply did (its client hung up, e.g.
        # an idle timeout during a long prompt): the messages they held before it, by id.
        # They are matched by those alone, so that the client's retry, or its next turn,
        # continues them (the flow keeps the left turn's tokens that still match).
        self._answered: dict[str, int] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _live(self, tenant: Tenant) -> OrderedDict[str, Session]:
        kept = self._kept.setdefault(tenant.name, OrderedDict())
        for sid in [sid for sid, s in kept.items() if s.closed]:
            self._forget(kept, sid)
        return kept

    def _forget(self, kept: OrderedDict[str, Session], session_id: str) -> None:
        kept.pop(session_id, None)
        self._keys.pop(session_id, None)
        self._answered.pop(session_id, None)

    def find(
        self, tenant: Tenant, messages: Sequence[Message], key: str = "", cache_salt: bytes = b""
    ) -> tuple[Session, int] | None:
        """The idle session kept under `key`, made with `cache_salt`, whose messages are the
        longest proper prefix of `messages` (at least one message long), and that prefix's
        length; it becomes the most recent."""
        kept = self._live(tenant)
        salt = session_salt(tenant, cache_salt)
        best: tuple[Session, int] | None = None
        for s in kept.values():
            n = self._answered.get(s.session_id, len(s.messages))
            if s.busy or not 0 < n < len(messages) or (best is not None and n <= best[1]):
                continue
            if self._keys.get(s.session_id, "") != key or s.salt != salt:
                continue
            if all(m.message() == w for m, w in zip(s.messages[:n], messages, strict=False)):
                best = (s, n)
        if best is not None:
            kept.move_to_end(best[0].session_id)
        return best

    def add(self, tenant: Tenant, session: Session, key: str = "") -> None:
        """Keep a new session (under `key`); close the oldest idle ones beyond the bound."""
        kept = self._live(tenant)
        kept[session.session_id] = session
        if key:
            self._keys[session.session_id] = key
        for old in [s for s in kept.values() if not s.busy][: max(0, len(kept) - PER_TENANT)]:
            self._close(tenant, old)

    def release(self, tenant: Tenant, session_id: str) -> None:
        """The tenant continues this session by its id: it is no longer the door's to close.
        Only the tenant's own kept sessions are looked at: another tenant's id changes nothing."""
        kept = self._kept.get(tenant.name)
        if kept is not None:
            self._forget(kept, session_id)

    async def make_room(self, tenant: Tenant) -> None:
        """Close the tenant's oldest idle kept session if its session quota is reached, so
        that the door's sessions never stand in the way of the tenant's own."""
        limit = tenant.quota.max_sessions
        if not limit or len(self.manager.owned(tenant)) < limit:
            return
        idle = [s for s in self._live(tenant).values() if not s.busy]
        if idle:
            self._forget(self._kept[tenant.name], idle[0].session_id)
            await self._close_now(idle[0], tenant)

    async def converse(
        self,
        tenant: Tenant,
        messages: Sequence[Message],
        turn: Turn,
        *,
        key: str = "",
        cache_salt: bytes = b"",
        context_policy: str = "",
    ) -> tuple[str, AsyncIterator[Chunk], bool]:
        """Answer a conversation sent whole: in the session kept under `key` and made with
        `cache_salt` that it continues (only what is new is evaluated), or in a new one kept
        so, whose system prompt is the conversation's leading system message. The session's
        id, the reply, and whether a kept session was continued."""
        m = self.manager
        found = self.find(tenant, messages, key, cache_salt)
        if found is not None:
            # The whole conversation: if another request moved the session on meanwhile, the
            # flow keeps what still matches.
            session_id = found[0].session_id
            stream = m.converse(session_id, tenant, messages=messages, whole=True, turn=turn)
            return session_id, self._watched(session_id, found[1], stream), True
        system = messages[0].content if messages and messages[0].role == "system" else ""
        rest = list(messages[1:] if system else messages)
        if not rest:
            raise InvalidRequest("the conversation has no message after its system prompt")
        await self.make_room(tenant)
        session = await m.create_session(
            tenant,
            system,
            SamplingOverrides(),
            (),
            persistent=False,
            cache_salt=cache_salt,
            context_policy=context_policy,
            tools=turn.tools or (),
        )
        self.add(tenant, session, key)
        stream = m.converse(session.session_id, tenant, messages=rest, whole=False, turn=turn)
        return session.session_id, self._watched(session.session_id, len(session.messages), stream), False

    async def _watched(
        self, session_id: str, answered: int, stream: AsyncIterator[Chunk]
    ) -> AsyncIterator[Chunk]:
        """The reply; until it ends, the session is matched by the `answered` messages it
        held before it."""
        self._answered[session_id] = answered
        async for chunk in stream:
            if chunk.finish_reason not in (None, "cancelled"):
                self._answered.pop(session_id, None)
            yield chunk

    def _close(self, tenant: Tenant, session: Session) -> None:
        self._forget(self._kept[tenant.name], session.session_id)
        task = asyncio.get_running_loop().create_task(self._close_now(session, tenant))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_now(self, session: Session, tenant: Tenant) -> None:
        try:
            await self.manager.close_session(session.session_id, tenant)
        except KvkeepError as e:
            log.debug("a kept session was not closed: %s", e)

    async def close_all(self) -> None:
        """Wait for the closes under way (at shutdown)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
