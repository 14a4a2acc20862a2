"""OpenAI's chat completions and completions on the HTTP door: `POST /v1/chat/completions` and
`POST /v1/completions`.

Handlers translate, as the gRPC servicer does: a body in (schema.py), a call to the
SessionManager's flows, a completion (or a stream of its chunks) out (shapes.py). A chat
request that names no session is answered in a session the door keeps (keep.py): a
conversation sent whole continues the kept session it extends, so only what is new is
evaluated; a completion that names none gets a new session, kept as a source for the prefix
cache. The extension `session_id` names a session to continue, or `"new"` to start one, whose
id the reply gives; a session started for a request that fails before the client learns its id
is closed again. A streamed reply starts once its first chunk exists, so errors before it (a
full queue, a full context) get their status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvkeepd import bulk
from kvkeepd.api.http.body import parsed
from kvkeepd.api.http.chat.schema import NEW_SESSION, ChatCompletionRequest, CompletionRequest
from kvkeepd.api.http.chat.shapes import Reply
from kvkeepd.api.http.handlers import Handlers
from kvkeepd.api.http.openai import domain_error
from kvkeepd.api.http.sse import STREAM_HEADERS, beating, sse
from kvkeepd.api.http.waiting import access, counted, unless_left
from kvkeepd.engine.backend import build_facts
from kvkeepd.errors import InvalidRequest, KvkeepError, NoChatTemplate
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant, check_salt
from kvkeepd.values.generation import Chunk, Turn
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides

log = logging.getLogger(__name__)

Render = Callable[[Chunk, bool], dict[str, Any]]


async def _nothing() -> None:
    return None


@dataclasses.dataclass(eq=False)
class ChatDoor(Handlers):
    """The chat completions' and completions' handlers (handlers.py says what they are
    given); a reply names the model as its request did."""

    #: What replies depend on besides the request: the model file, the llama.cpp build and
    #: the mode (exact or compact), so that a client can tell when they may change.
    fingerprint: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        mode = "exact" if self.manager.model.exact else "compact"
        self.fingerprint = f"{self.model_id} llama.cpp-{build_facts()['version']} {mode}"

    async def chat_completions(self, request: Request) -> Response:
        tenant = self.tenant(request)
        req = await parsed(await self.body(request), ChatCompletionRequest)
        # A stream opens once the prompt's evaluation begins (its first progress report),
        # not at its first token.
        turn = dataclasses.replace(req.turn(), progress=req.stream)
        messages = await bulk.run(req.chat_messages, large=len(req.messages) > bulk.LARGE_MESSAGES)
        if self.manager.template is None:
            raise NoChatTemplate("the model has no chat template; use /v1/completions")
        m = self.manager
        salt = req.salt()
        on_fail: Callable[[], Awaitable[None]] = _nothing
        if req.session_id is None:
            key = req.prompt_cache_key or ""
            session_id, stream, _ = await self.keep.converse(tenant, messages, turn, key=key, cache_salt=salt)
        elif req.session_id == NEW_SESSION:
            session, rest = await self._new_chat_session(
                tenant, messages, turn, persistent=req.persistent, cache_salt=salt
            )
            on_fail = self._closer(session, tenant)
            session_id = req.session_id = session.session_id
            stream = m.converse(session_id, tenant, messages=rest, whole=False, turn=turn)
        else:
            await self._check_salt(tenant, req.session_id, salt)
            self.keep.release(tenant, req.session_id)
            session_id = req.session_id
            stream = m.converse(session_id, tenant, messages=messages, whole=False, turn=turn)
        access(request).session = session_id
        reply = self._reply("chat", req.session_id, req.model)
        top = req.top_logprobs or 0
        if req.stream:
            render: Render = lambda c, first: reply.chat_chunk(c, top, first)  # noqa: E731
            return await self._events(
                request, stream, render, reply, req.include_usage, on_fail, progress=req.return_progress
            )
        chunks = await self._collect(request, stream, on_fail)
        return JSONResponse(reply.chat("".join(c.text for c in chunks), chunks, top))

    async def _new_chat_session(
        self, tenant: Tenant, messages: Sequence[Message], turn: Turn, *, persistent: bool, cache_salt: bytes
    ) -> tuple[Session, list[Message]]:
        """A new session whose system prompt is the conversation's leading system message
        (rendered with the turn's tools), made with `cache_salt`, and the messages that
        follow it."""
        system = messages[0].content if messages[0].role == "system" else ""
        rest = list(messages[1:] if system else messages)
        if not rest:
            raise InvalidRequest("the conversation has no message after its system prompt")
        await self.keep.make_room(tenant)
        session = await self.manager.create_session(
            tenant,
            system,
            SamplingOverrides(),
            (),
            persistent=persistent,
            cache_salt=cache_salt,
            tools=turn.tools or (),
        )
        return session, rest

    async def _check_salt(self, tenant: Tenant, session_id: str, cache_salt: bytes) -> None:
        """Refuse a request continuing the tenant's session under another cache salt than the
        session's own (given none, it continues under the session's)."""
        if cache_salt:
            session = await self.manager.find(session_id, tenant)
            check_salt(tenant, cache_salt, session.salt)

    async def completions(self, request: Request) -> Response:
        """The legacy completions: a prompt (text or token ids) continued as it is."""
        tenant = self.tenant(request)
        req = await parsed(await self.body(request), CompletionRequest)
        turn = req.turn()
        prompt, token_ids = req.prompt_parts()
        salt = req.salt()
        on_fail: Callable[[], Awaitable[None]] = _nothing
        if req.session_id is None or req.session_id == NEW_SESSION:
            if not prompt and not token_ids:
                raise InvalidRequest("the prompt is empty")
            await self.keep.make_room(tenant)
            session = await self.manager.create_session(
                tenant, "", SamplingOverrides(), (), persistent=req.persistent, cache_salt=salt
            )
            if req.session_id is None:
                self.keep.add(tenant, session)  # a source for the prefix cache
            else:
                on_fail = self._closer(session, tenant)
                req.session_id = session.session_id
            session_id = session.session_id
        else:
            await self._check_salt(tenant, req.session_id, salt)
            self.keep.release(tenant, req.session_id)
            session_id = req.session_id
        access(request).session = session_id
        stream = self.manager.generate(
            session_id, tenant, prompt=prompt, prompt_token_ids=token_ids, parse_special=False, turn=turn
        )
        reply = self._reply("text", req.session_id, req.model)
        top = req.logprobs or 0
        if req.stream:
            render: Render = lambda c, _first: reply.completion_chunk(c, top)  # noqa: E731
            return await self._events(request, stream, render, reply, req.include_usage, on_fail)
        chunks = await self._collect(request, stream, on_fail)
        return JSONResponse(reply.completion("".join(c.text for c in chunks), chunks, top))

    # ---- replies -----------------------------------------------------------------------------

    def _reply(self, kind: str, session_id: str | None, model: str) -> Reply:
        """A reply's shape; it names the model as the request did (llama-server does so too)."""
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        name = model or self.model_id
        return Reply(
            kind, prefix + secrets.token_hex(12), int(time.time()), name, session_id, self.fingerprint
        )

    def _closer(self, session: Session, tenant: Tenant) -> Callable[[], Awaitable[None]]:
        """Close a session made for a request that failed before the client learnt its id."""

        async def close() -> None:
            with contextlib.suppress(KvkeepError):
                await self.manager.close_session(session.session_id, tenant)

        return close

    async def _collect(
        self, request: Request, stream: AsyncIterator[Chunk], on_fail: Callable[[], Awaitable[None]]
    ) -> list[Chunk]:
        async def collect() -> list[Chunk]:
            return [c async for c in counted(request, stream)]

        try:
            return await unless_left(request, collect())
        except (KvkeepError, ClientDisconnect):
            await on_fail()
            raise

    async def _events(
        self,
        request: Request,
        stream: AsyncIterator[Chunk],
        render: Render,
        reply: Reply,
        include_usage: bool,
        on_fail: Callable[[], Awaitable[None]],
        *,
        progress: bool = True,
    ) -> Response:
        """The reply as a stream of chunks; progress reports beyond the first are sent only
        where the client asked for them (`progress`)."""
        it = aiter(counted(request, stream))
        try:
            first = await unless_left(request, anext(it))
        except (KvkeepError, ClientDisconnect):
            await on_fail()
            raise

        async def events() -> AsyncGenerator[bytes, None]:
            is_first, last = True, first
            try:
                async with contextlib.aclosing(beating(first, it, self.heartbeat)) as beats:
                    async for chunk in beats:
                        if chunk is None:
                            # A heartbeat: a chunk that adds nothing.
                            yield sse(render(Chunk(text="", token_ids=()), is_first))
                            is_first = False
                            continue
                        if chunk.progress is not None and not progress:
                            if not is_first:
                                continue
                            chunk = dataclasses.replace(chunk, progress=None)  # the opening only
                        # A chunk of nothing (the tokens of a call's syntax) goes unsent.
                        if is_first or _says_something(chunk):
                            yield sse(render(chunk, is_first))
                            is_first = False
                        last = chunk
                        if chunk.finish_reason is not None:
                            break
                if include_usage and last.usage is not None:
                    yield sse(reply.usage_chunk(last.usage))
                yield sse("[DONE]")
            except Exception as e:
                if not isinstance(e, KvkeepError) or type(e) is KvkeepError:
                    log.error("internal error", exc_info=e)
                yield sse(domain_error(e if isinstance(e, KvkeepError) else KvkeepError())[1])
            finally:
                # A client that left stops the generation (within one engine step).
                if isinstance(it, AsyncGenerator):
                    await it.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)


def _says_something(c: Chunk) -> bool:
    return bool(c.text or c.tool_calls or c.logprobs or c.finish_reason or c.progress is not None)
