"""Anthropic's Messages API on the HTTP door: `POST /v1/messages` and `POST
/v1/messages/count_tokens`, so that Claude Code and Anthropic's SDKs run on the served model.

A conversation is answered as the chat door answers one sent whole: in a session the door
keeps (keep.py), so the next request that resends it continues that session and evaluates
only what is new; a `cache_control` breakpoint keeps the state up to it for its TTL, where
any later prompt of the tenant that begins the same way finds it (SessionManager.keep_prefixes),
or, when the request gives a `cache_salt`, any later prompt that gives the same salt.
Calls are the chat door's: in the model's own format, held to each tool's
schema. The caller is the tenant its `x-api-key` names, or its bearer token, as on the other
routes; `anthropic-version` and `anthropic-beta` are accepted whatever they say. Errors are
Anthropic's envelope on these routes (shapes.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvkeepd import bulk
from kvkeepd.api.http.anthropic.schema import ConversationBody, MessagesRequest
from kvkeepd.api.http.anthropic.shapes import MessageShape, domain_error, error, event
from kvkeepd.api.http.body import BodyTooLarge, parsed, read_body
from kvkeepd.api.http.keep import SessionKeep
from kvkeepd.api.http.sse import STREAM_HEADERS, beating
from kvkeepd.api.http.waiting import access, client_closed, counted, unless_left
from kvkeepd.errors import KvkeepError, NoChatTemplate, Unauthenticated, Unavailable
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.values.generation import Chunk, Turn
from kvkeepd.values.messages import Message
from kvkeepd.values.toolcall import join_deltas

log = logging.getLogger(__name__)

B = TypeVar("B", bound=BaseModel)
Handler = Callable[[Request], Awaitable[Response]]
# The calls whose arguments the door remembers as the model wrote them (a client resends a
# call's input as an object, which JSON may write otherwise): the latest, of all tenants.
REMEMBERED_CALLS = 4096


class MessagesDoor:
    """The Messages API's handlers over the door's manager and kept sessions; `accepting`
    says whether the daemon still takes requests; a stream that says nothing for `heartbeat`
    seconds sends a `ping`. `create` and `count_tokens` are its routes' endpoints."""

    def __init__(
        self,
        manager: SessionManager,
        model_id: str,
        keep: SessionKeep,
        body_limit: int,
        *,
        accepting: Callable[[], bool],
        heartbeat: float,
    ) -> None:
        self.manager = manager
        self.model_id = model_id
        self.keep = keep
        self.body_limit = body_limit
        self.accepting = accepting
        self.heartbeat = heartbeat
        self._calls: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.create = self._endpoint(self._create)
        self.count_tokens = self._endpoint(self._count_tokens)

    # ---- routes ------------------------------------------------------------------------------

    async def _create(self, request: Request) -> Response:
        tenant = self._tenant(request)
        req = await self._parse(request, MessagesRequest)
        salt = req.salt()
        turn = req.turn()
        messages = await bulk.run(
            lambda: req.conversation(self._recall(tenant)), large=len(req.messages) > bulk.LARGE_MESSAGES
        )
        marks = req.breakpoints(messages)
        session_id, stream = await self._converse(request, tenant, messages, turn, salt)
        shape = MessageShape("msg_" + secrets.token_hex(12), req.model or self.model_id)

        async def keep(last: Chunk) -> int:
            if not marks or last.finish_reason == "cancelled":
                return 0
            return await self._keep(tenant, session_id, marks)

        if req.stream:
            return await self._events(request, tenant, stream, shape, keep)

        async def collect() -> tuple[list[Chunk], int]:
            chunks = [c async for c in stream]
            return chunks, await keep(chunks[-1])

        chunks, kept = await unless_left(request, collect())
        self._remember(tenant, chunks)
        return JSONResponse(shape.message(chunks, kept))

    async def _count_tokens(self, request: Request) -> Response:
        tenant = self._tenant(request)
        req = await self._parse(request, ConversationBody)
        messages = await bulk.run(
            lambda: req.conversation(self._recall(tenant)), large=len(req.messages) > bulk.LARGE_MESSAGES
        )
        n = await self.manager.count_tokens(messages, req.chat_tools())
        return JSONResponse({"input_tokens": n})

    # ---- conversations -----------------------------------------------------------------------

    async def _converse(
        self, request: Request, tenant: Tenant, messages: Sequence[Message], turn: Turn, cache_salt: bytes
    ) -> tuple[str, AsyncIterator[Chunk]]:
        """The session and the reply's stream: in the kept session (made with `cache_salt`)
        whose conversation this one continues, or in a new one (kept) whose system prompt is
        the conversation's."""
        if self.manager.template is None:
            raise NoChatTemplate("the model has no chat template: the Messages API needs one")
        session_id, stream, _ = await self.keep.converse(tenant, messages, turn, cache_salt=cache_salt)
        access(request).session = session_id
        return session_id, counted(request, stream)

    async def _keep(self, tenant: Tenant, session_id: str, marks: list[tuple[list[Message], float]]) -> int:
        """Keep the prefixes the client marked, each for its time to live: the tokens of
        the longest newly stored. A breakpoint that cannot be kept (the tenant's quota, the
        disk budget) costs the reply nothing: it is logged, and reported as not stored."""
        kept = 0
        for ttl in sorted({ttl for _, ttl in marks}):
            prefixes = [p for p, t in marks if t == ttl]
            try:
                kept = max(kept, await self.manager.keep_prefixes(session_id, tenant, prefixes, ttl))
            except KvkeepError as e:
                log.info("a cache breakpoint of session %s was not kept: %s", session_id, e)
        return kept

    def _recall(self, tenant: Tenant) -> Callable[[str, dict[str, Any]], str | None]:
        def recall(call_id: str, given: dict[str, Any]) -> str | None:
            text = self._calls.get((tenant.name, call_id))
            return text if text is not None and _same_json(text, given) else None

        return recall

    def _remember(self, tenant: Tenant, chunks: Sequence[Chunk]) -> None:
        for call in join_deltas((), (d for c in chunks for d in c.tool_calls)):
            self._calls[(tenant.name, call.call_id)] = call.arguments
            self._calls.move_to_end((tenant.name, call.call_id))
        while len(self._calls) > REMEMBERED_CALLS:
            self._calls.popitem(last=False)

    async def _events(
        self,
        request: Request,
        tenant: Tenant,
        stream: AsyncIterator[Chunk],
        shape: MessageShape,
        keep: Callable[[Chunk], Awaitable[int]],
    ) -> Response:
        it = aiter(stream)
        # The first chunk (the prompt's first progress report) before the response starts:
        # errors until then get their status.
        first = await unless_left(request, anext(it))

        async def events() -> AsyncGenerator[bytes, None]:
            chunks: list[Chunk] = []
            last = first
            try:
                for e in shape.opening(first):
                    yield e
                # While the prompt is evaluated, and whenever else nothing is said for a while,
                # a `ping` (as Anthropic's streams send).
                async with contextlib.aclosing(beating(first, it, self.heartbeat)) as beats:
                    async for chunk in beats:
                        if chunk is None:
                            yield event({"type": "ping"})
                            continue
                        if chunk.progress is None:
                            chunks.append(chunk)
                            for e in shape.delta(chunk):
                                yield e
                        last = chunk
                        if chunk.finish_reason is not None:
                            break
                self._remember(tenant, chunks)
                kept = await keep(last)
                for e in shape.closing(last, kept):
                    yield e
            except Exception as e:
                if not isinstance(e, KvkeepError) or type(e) is KvkeepError:
                    log.error("internal error", exc_info=e)
                _, body = domain_error(e if isinstance(e, KvkeepError) else KvkeepError())
                yield event(body)
            finally:
                # A client that left stops the generation (within one engine step).
                if isinstance(it, AsyncGenerator):
                    await it.aclose()

        return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)

    # ---- plumbing ----------------------------------------------------------------------------

    def _endpoint(self, fn: Handler) -> Handler:
        """Errors of a handler in Anthropic's envelope."""

        async def handle(request: Request) -> Response:
            try:
                return await fn(request)
            except KvkeepError as e:
                if type(e) is KvkeepError:
                    log.error("internal error", exc_info=e)
                status, body = domain_error(e)
                return JSONResponse(body, status)
            except ValidationError as e:
                return JSONResponse(error("invalid_request_error", _describe(e)), 400)
            except ClientDisconnect:
                return client_closed(request)
            except BodyTooLarge:
                message = f"the request body is larger than the limit of {self.body_limit} bytes"
                return JSONResponse(error("request_too_large", message), 413)
            except Exception as e:
                log.error("internal error", exc_info=e)
                status, body = domain_error(KvkeepError())
                return JSONResponse(body, status)

        return handle

    def _tenant(self, request: Request) -> Tenant:
        """The caller: the tenant its `x-api-key` names (Anthropic's header), or its bearer
        token."""
        if not self.accepting():
            raise Unavailable("the daemon is shutting down")
        key = request.headers.get("x-api-key")
        authorization = f"Bearer {key}" if key else request.headers.get("authorization")
        try:
            tenant = self.manager.resolve_tenant(authorization)
        except Unauthenticated:
            if authorization:
                raise
            raise Unauthenticated(
                "an API key is required (x-api-key: KEY, or authorization: Bearer KEY)"
            ) from None
        access(request).tenant = tenant.name
        return tenant

    async def _parse(self, request: Request, model: type[B]) -> B:
        return await parsed(await read_body(request, self.body_limit), model)


def _same_json(text: str, value: dict[str, Any]) -> bool:
    try:
        return bool(json.loads(text) == value)
    except ValueError:
        return False


def _describe(e: ValidationError) -> str:
    """The first problem of a body, naming the field."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    message = "field required" if first.get("type") == "missing" else first.get("msg", "invalid body")
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where + ': ' if where else ''}{message}{more}"
