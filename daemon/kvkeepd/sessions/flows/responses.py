"""Stored responses: a conversation the daemon holds and continues by a response's id.

A stored response is a checkpoint (kind "response") in the durable store: the session's
state after it — KV blocks (only those the store lacks are written), logits, sampler
position, history and messages — and, committed with it in one catalog transaction, its
record: what the request's door said of it (OpenAI's response object and input items),
the response it continues and its instructions. Its id is its checkpoint's (`resp_X` is
`c_X`), so finding one is one catalog lookup, and an acknowledged response is never lost:
the commit comes before the reply's end is sent.

Each chain of responses is answered in an ephemeral session of its own, kept (per tenant,
the most recently used) at its newest response: a request whose `previous_response_id` is
that response continues the session in place, and nothing is evaluated again. Any other
response — an older one (a branch), one whose session was let go, or one another daemon
sharing the catalog and store made — is forked from its checkpoint: its whole state from
RAM where this daemon kept it, else its blocks from disk or the shared store. A request
that stores nothing (`store` false), or that fails, leaves the session as it was: cut back
to its response's cells (nothing read), or closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvkeepd.config.settings import Settings
from kvkeepd.errors import InvalidRequest, KvkeepError, NoChatTemplate, NotFound, Unavailable
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.flows.checkpointing import Checkpointing
from kvkeepd.sessions.flows.generation import Conversations
from kvkeepd.sessions.flows.lifecycle import Lifecycle
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.ledger import Ledger
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.placement import Docked, HistoryOnly, InSlot, Parked, Stored
from kvkeepd.sessions.prompting.templates import ChatTemplate
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant, check_salt
from kvkeepd.storage.checkpoints import CHECKPOINT_ID_PREFIX
from kvkeepd.storage.writes import store_write
from kvkeepd.values.generation import Chunk, Turn
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides

log = logging.getLogger(__name__)

RESPONSE_ID_PREFIX = "resp_"
_RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{24}$")
#: Chains kept in place per tenant: agents running at once, each one's session parked in
#: RAM (or spilled) when not in a slot, within --ram-cache like any other session.
KEPT_PER_TENANT = 16
#: Stored responses one sweep expires.
EXPIRED_PER_SWEEP = 100
#: Where a resumed response's state came from (the resumes metric's labels): the session
#: kept in place (in its slot, a dock, RAM, or spilled to disk), the response's whole state
#: kept in RAM, its blocks from the local disk or a shared store, or nowhere (evaluated again).
SOURCES = ("slot", "dock", "ram", "disk", "shared", "evaluated")

#: What the door makes of a finished reply (its chunks): the document stored with it.
Describe = Callable[[Sequence[Chunk]], dict[str, Any]]
Put = Callable[[Chunk], None]


def new_response_id() -> str:
    return RESPONSE_ID_PREFIX + secrets.token_hex(12)


def checkpoint_of(response_id: str) -> str:
    """The id of the checkpoint that is this response."""
    return CHECKPOINT_ID_PREFIX + response_id.removeprefix(RESPONSE_ID_PREFIX)


@dataclass(frozen=True)
class ResponseRecord:
    """What is stored with a response's checkpoint: the response it continues, the
    instructions it was given (None: none), and the door's document."""

    response_id: str
    previous_response_id: str
    instructions: str | None
    document: dict[str, Any]

    def encode(self) -> bytes:
        # NOTE: previous_response_id comes first: a listing reads it from the record's
        # first bytes alone (response_list.py).
        body = {
            "previous_response_id": self.previous_response_id,
            "instructions": self.instructions,
            "document": self.document,
        }
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

    @staticmethod
    def decode(response_id: str, data: bytes) -> ResponseRecord:
        body = json.loads(data)
        return ResponseRecord(
            response_id, body["previous_response_id"], body["instructions"], body["document"]
        )


@dataclass(frozen=True)
class ResponseRequest:
    """A request for a response: the messages it adds to the conversation of
    `previous_response_id` (or to a new one), under `instructions` (the system message;
    a previous response's are not carried over), with `context_policy` ("truncate": earlier
    turns make way when it does not fit). A new conversation's session is made with
    `cache_salt`; a stored one keeps the salt it was begun with, and another is refused."""

    response_id: str
    previous_response_id: str
    instructions: str | None
    messages: tuple[Message, ...]
    turn: Turn
    store: bool
    context_policy: str = ""
    cache_salt: bytes = b""


@dataclass
class _Kept:
    """A chain's session, and what it was when kept at its newest response: anyone who
    used it since (over gRPC, by its id) moved it, and it is no longer that response."""

    session: Session
    last_used_at: float
    n_tokens: int
    draws: int

    def intact(self) -> bool:
        s = self.session
        return (
            not s.closed
            and s.last_used_at == self.last_used_at
            and len(s.state.tokens) == self.n_tokens
            and s.state.draws == self.draws
        )


class Responses:
    """The stored responses' flows over the sessions a SessionHost holds."""

    def __init__(
        self,
        host: SessionHost,
        *,
        settings: Settings,
        residency: Residency,
        persistence: Persistence,
        lifecycle: Lifecycle,
        checkpointing: Checkpointing,
        conversations: Conversations,
        template: ChatTemplate | None,
        ledger: Ledger,
    ) -> None:
        self.host = host
        self.settings = settings
        self.residency = residency
        self.persistence = persistence
        self.durable = persistence.durable
        self.lifecycle = lifecycle
        self.checkpointing = checkpointing
        self.conversations = conversations
        self.template = template
        # Per tenant, the session of each chain kept in place, by its newest response.
        self._kept: dict[str, OrderedDict[str, _Kept]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Where resumes are counted, by where the state came from (SOURCES).
        self.ledger = ledger

    # ---- lookups -------------------------------------------------------------------------

    async def lookup(self, response_id: str, tenant: Tenant) -> ResponseRecord:
        """The tenant's stored response; NotFound if there is none (another tenant's gets
        the same answer, by the same path: one lookup, then the owner)."""
        found = None
        if _RESPONSE_ID.match(response_id):
            found = await asyncio.to_thread(self.durable.catalog.response, checkpoint_of(response_id))
        if found is None or found[0].tenant != tenant.name:
            raise NotFound(f"no response {response_id[:80]!r}")
        return ResponseRecord.decode(response_id, found[1])

    # ---- answering -----------------------------------------------------------------------

    async def answer(
        self, tenant: Tenant, request: ResponseRequest, describe: Describe
    ) -> AsyncIterator[Chunk]:
        """Stream the reply to `request`; a stored one is committed (`describe` gives its
        document) before its last chunk is sent."""
        if self.template is None:
            raise NoChatTemplate("the model has no chat template; use /v1/completions")
        if not request.messages and not request.previous_response_id:
            raise InvalidRequest("the input is empty: give at least one item, or previous_response_id")
        stream: AsyncIterator[Chunk] = self.host.ops.stream(
            lambda put: self._answer(tenant, request, describe, put)
        )
        async for chunk in stream:
            yield chunk

    async def _answer(self, tenant: Tenant, request: ResponseRequest, describe: Describe, put: Put) -> None:
        if request.store:
            await self.persistence.check_disk()
            await self.persistence.check_stored(tenant)
        session, base, in_place = await self._session_for(tenant, request)
        chunks: list[Chunk] = []
        last: list[Chunk] = []

        def hold(chunk: Chunk) -> None:
            chunks.append(chunk)
            if chunk.finish_reason is None:
                put(chunk)
                return
            # Every token goes out before the commit, the end after it (durability.md).
            if chunk.text or chunk.token_ids or chunk.tool_calls:
                put(_without_end(chunk))
            last.append(_end_of(chunk))

        stored = False
        try:
            if base is not None:
                check_salt(tenant, request.cache_salt, session.salt)
            messages, whole = self._messages(session, base, request)
            # No input continues the previous response: one more reply after it.
            await self.conversations.converse(
                session, hold, messages=messages, whole=whole, turn=request.turn, again=not request.messages
            )
            done = bool(last) and last[0].finish_reason != "cancelled"
            if not done:
                # Its requester left, or its session was closed under it: nothing is kept.
                raise Unavailable("the response was cancelled before it ended; nothing was stored")
            if request.store:
                record = ResponseRecord(
                    request.response_id, request.previous_response_id, request.instructions, describe(chunks)
                )
                # In place, the response before `base` is two behind the session now: its
                # whole state gives way (a branch from it loads its blocks), and the memory
                # it frees takes the new state.
                older = base.previous_response_id if base is not None and in_place else ""
                await self._store(tenant, session, record, older)
                stored = True
        finally:
            if not stored:
                # An operation of its own: one whose requester left still ends this.
                await self.host.ops.run(self._let_go(tenant, session, base if in_place else None))
        put(last[0])

    async def _session_for(
        self, tenant: Tenant, request: ResponseRequest
    ) -> tuple[Session, ResponseRecord | None, bool]:
        """The session to answer in, the response it continues (None: a new conversation),
        and whether it is that response's kept session (in place) rather than a fork."""
        if not request.previous_response_id:
            await self._make_room(tenant)
            session = await self.lifecycle.create(
                tenant,
                request.instructions or "",
                SamplingOverrides(),
                (),
                persistent=False,
                cache_salt=request.cache_salt,
                context_policy=request.context_policy,
                tools=request.turn.tools or (),
            )
            return session, None, False
        base = await self.lookup(request.previous_response_id, tenant)
        kept = self._claim(tenant, base.response_id)
        if kept is not None:
            session, in_place = kept, True
            self.ledger.resumed(_tier(self.residency.where(session)))
        else:
            await self._make_room(tenant)
            checkpoint_id = checkpoint_of(base.response_id)
            source = "ram" if checkpoint_id in self.residency.wholes else "disk"
            if source == "disk" and self.durable.store.remote:
                source = "shared"
            session, evaluated = await self.checkpointing.fork("", checkpoint_id, False, tenant)
            in_place = False
            self.ledger.resumed("evaluated" if evaluated else source)
        if request.context_policy:
            # The request's truncation holds for its turn (the session is this request's alone).
            session.context_policy = "truncate" if request.context_policy == "truncate" else "error"
        return session, base, in_place

    def _messages(
        self, session: Session, base: ResponseRecord | None, request: ResponseRequest
    ) -> tuple[list[Message], bool]:
        """The messages to add to the session, or (with True) the whole conversation: when
        the instructions are not the previous response's, the conversation is rendered again
        under the new ones (the session keeps what still matches, token by token)."""
        if base is None or base.instructions == request.instructions:
            return list(request.messages), False
        held = [m.message() for m in session.messages]
        if base.instructions is not None and held and held[0].role == "system":
            held = held[1:]
        lead = [Message("system", request.instructions)] if request.instructions is not None else []
        return [*lead, *held, *request.messages], True

    async def _store(self, tenant: Tenant, session: Session, record: ResponseRecord, older: str) -> None:
        """Commit the response: the session's state as it is now, and its record. The whole
        state of `older` (a response id, or "") is no longer kept in RAM."""
        checkpoint_id = checkpoint_of(record.response_id)
        if older:
            self.residency.wholes.drop(checkpoint_of(older))
        async with self.host.use(session):
            kv = await self.residency.state_of(session, rounded=True)
            await self.persistence.save_response(session, kv, checkpoint_id, record.encode())
            self.residency.keep_response(checkpoint_id, kv)
            self.residency.lineage.remember(session, checkpoint_id)
        self._keep(tenant, record.response_id, session)

    async def _let_go(self, tenant: Tenant, session: Session, base: ResponseRecord | None) -> None:
        """Put a session that answered nothing to keep back as it was: cut to its
        response's cells (`base`: the response it was kept at), or closed."""
        if base is not None and not session.closed:
            checkpoint_id = checkpoint_of(base.response_id)
            try:
                async with self.host.use(session):
                    snap = await asyncio.to_thread(self.durable.snapshot, checkpoint_id)
                    back = await self.residency.rewind_to(
                        session, checkpoint_id, snap, self.durable.layout_desc
                    )
                    if back:
                        self.host.touch(session)
                if back:
                    self._keep(tenant, base.response_id, session)
                    return
            except KvkeepError as e:
                log.debug("a response's session was not cut back: %s", e)
        with contextlib.suppress(KvkeepError):
            await self.lifecycle.close_session(session)

    # ---- the kept sessions -----------------------------------------------------------------

    def _claim(self, tenant: Tenant, response_id: str) -> Session | None:
        """The session kept at this response, taken out of the keep (its request's alone),
        if it is still that response."""
        kept = self._kept.get(tenant.name)
        found = kept.pop(response_id, None) if kept is not None else None
        return found.session if found is not None and found.intact() else None

    def _keep(self, tenant: Tenant, response_id: str, session: Session) -> None:
        """Keep the session at this response; the oldest beyond the bound are closed (in
        operations of their own: the request does not wait for them)."""
        kept = self._kept.setdefault(tenant.name, OrderedDict())
        state = session.state
        kept[response_id] = _Kept(session, session.last_used_at, len(state.tokens), state.draws)
        for rid in [rid for rid, k in kept.items() if not k.intact()]:
            del kept[rid]
        while len(kept) > KEPT_PER_TENANT:
            _, old = kept.popitem(last=False)
            task = asyncio.get_running_loop().create_task(self.host.ops.run(self._close(old.session)))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _make_room(self, tenant: Tenant) -> None:
        """Close the tenant's oldest kept session if its session quota is reached, so that
        the kept sessions never stand in the way of the tenant's own."""
        limit = tenant.quota.max_sessions
        kept = self._kept.get(tenant.name)
        held = sum(1 for s in self.host.sessions.values() if s.tenant == tenant.name and not s.closed)
        if not limit or not kept or held < limit:
            return
        _, old = kept.popitem(last=False)
        await self._close(old.session)

    async def _close(self, session: Session) -> None:
        with contextlib.suppress(KvkeepError):
            await self.lifecycle.close_session(session)

    # ---- delete and expiry -----------------------------------------------------------------

    async def delete(self, response_id: str, tenant: Tenant) -> None:
        """Delete the tenant's stored response, and what only it referenced: its blocks no
        other checkpoint shares, its whole state kept in RAM, and its session kept in place."""
        await self.lookup(response_id, tenant)
        await self.host.ops.run(self._delete(response_id, tenant))

    async def _delete(self, response_id: str, tenant: Tenant | None) -> None:
        checkpoint_id = checkpoint_of(response_id)
        try:
            await store_write(self.durable.delete_with_blocks, checkpoint_id)
        except NotFound:
            raise NotFound(f"no response {response_id!r}") from None
        self.residency.wholes.drop(checkpoint_id)
        for name, kept in self._kept.items():
            if tenant is None or name == tenant.name:
                found = kept.pop(response_id, None)
                if found is not None:
                    await self._close(found.session)

    async def expire(self, now: float) -> int:
        """Delete stored responses older than --response-ttl (run by the sweeper, within
        its operation); returns how many."""
        ttl = self.settings.response_ttl
        if ttl <= 0:
            return 0
        old = await asyncio.to_thread(self.durable.catalog.old_responses, now - ttl, EXPIRED_PER_SWEEP)
        n = 0
        for checkpoint_id in old:
            response_id = RESPONSE_ID_PREFIX + checkpoint_id.removeprefix(CHECKPOINT_ID_PREFIX)
            with contextlib.suppress(NotFound):
                await self._delete(response_id, None)
                n += 1
        if n:
            log.info("%d stored responses expired", n)
        return n


def _tier(where: object) -> str:
    match where:
        case InSlot():
            return "slot"
        case Docked():
            return "dock"
        case Parked():
            return "ram"
        case Stored():
            return "disk"
        case HistoryOnly():
            return "evaluated"
    return "evaluated"


def _without_end(chunk: Chunk) -> Chunk:
    return replace(chunk, finish_reason=None, usage=None)


def _end_of(chunk: Chunk) -> Chunk:
    return replace(chunk, text="", token_ids=(), logprobs=(), tool_calls=())
