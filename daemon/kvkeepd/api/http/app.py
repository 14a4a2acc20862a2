"""The OpenAI-compatible HTTP door: /v1/chat/completions, /v1/completions, /v1/models and
/v1/responses (responses/).

Handlers translate, as the gRPC servicer does: an OpenAI body in, a call to the
SessionManager's flows, an OpenAI body (or a stream of server-sent events) out. Callers are
resolved by the same `Tenants.resolve` as gRPC callers; errors are OpenAI-style JSON bodies
whose HTTP status follows the error table (docs/errors.md). A streamed response starts once its
first chunk exists, so errors before it (a full queue, a full context) get their status.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message as AsgiMessage
from starlette.types import Receive, Scope, Send

from kvkeepd import bulk
from kvkeepd.api.access import Access
from kvkeepd.api.http.anthropic.door import MessagesDoor
from kvkeepd.api.http.browsers import BrowserGuard, BrowserPolicy
from kvkeepd.api.http.chat.schema import NEW_SESSION, ChatCompletionRequest, CompletionRequest, GenerationBody
from kvkeepd.api.http.chat.shapes import Reply
from kvkeepd.api.http.console.routes import OFF, Console
from kvkeepd.api.http.keep import SessionKeep
from kvkeepd.api.http.openai import domain_error, error
from kvkeepd.api.http.responses.door import ResponsesDoor
from kvkeepd.api.http.sse import STREAM_HEADERS, beating, sse
from kvkeepd.api.http.waiting import access, client_closed, counted, unless_left
from kvkeepd.engine.backend import build_facts
from kvkeepd.errors import InvalidRequest, KvkeepError, NoChatTemplate, NotFound, Unavailable
from kvkeepd.request_limits import MAX_CONCURRENT_RPCS
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant, check_salt
from kvkeepd.values.generation import Chunk, Turn
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides

log = logging.getLogger(__name__)

B = TypeVar("B", bound=GenerationBody)
T = TypeVar("T")
Render = Callable[[Chunk, bool], dict[str, Any]]


class BodyTooLarge(Exception):
    """A request body beyond the daemon's message limit (413)."""


async def _nothing() -> None:
    return None


class OpenAiDoor:
    """The door's handlers over a SessionManager; `asgi` is the ASGI application."""

    def __init__(
        self,
        manager: SessionManager,
        model_id: str,
        body_limit: int,
        aliases: Sequence[str] = (),
        *,
        browsers: BrowserPolicy,
        heartbeat: float,
        console: str = OFF,
    ) -> None:
        self.manager = manager
        self.model_id = model_id
        #: What /v1/models lists: the model's id, then other names it goes by. A request may
        #: name any model: one is served.
        self.names = (model_id, *(a for a in aliases if a != model_id))
        self.body_limit = body_limit
        #: Seconds a stream may say nothing before it sends a heartbeat (sse.beating).
        self.heartbeat = heartbeat
        # What replies depend on besides the request: the model file, the llama.cpp build and
        # the mode (exact or compact), so that a client can tell when they may change.
        mode = "exact" if manager.model.exact else "compact"
        self.fingerprint = f"{model_id} llama.cpp-{build_facts()['version']} {mode}"
        self.keep = SessionKeep(manager)
        self.accepting = True
        self.in_flight = 0
        self.created = int(time.time())
        self.responses = ResponsesDoor(
            manager, model_id, self.keep, tenant=self._tenant, body=self._body, heartbeat=heartbeat
        )
        self.messages = MessagesDoor(
            manager, model_id, self.keep, body_limit, accepting=lambda: self.accepting, heartbeat=heartbeat
        )
        stored = "/v1/responses/{response_id}"
        # The web console (console/): its page at / and its routes, unless --console off.
        shown = Console(manager, console, model_id, tenant=self._tenant, body=self._body)
        pages = shown.routes(self._endpoint) if console != OFF else []
        routes = Starlette(
            routes=[
                Route(
                    "/v1/responses",
                    # The Responses API's conversation is its input, its schema in text.format.
                    self._endpoint(
                        self.responses.create, "input", {"messages": "input", "json_schema": "text"}
                    ),
                    methods=["POST"],
                ),
                Route("/v1/responses", self._endpoint(self.responses.listing), methods=["GET"]),
                Route(stored, self._endpoint(self.responses.retrieve), methods=["GET"]),
                Route(stored, self._endpoint(self.responses.delete), methods=["DELETE"]),
                Route(stored + "/input_items", self._endpoint(self.responses.input_items), methods=["GET"]),
                Route("/v1/chat/completions", self._endpoint(self.chat_completions), methods=["POST"]),
                Route("/v1/messages", self.messages.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.messages.count_tokens, methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.completions, "prompt"), methods=["POST"]),
                Route("/v1/models", self._endpoint(self.models), methods=["GET"]),
                Route("/v1/models/{model_id:path}", self._endpoint(self.model), methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.health, methods=["GET"]),
                *pages,
            ],
            exception_handlers={HTTPException: self._http_error},
        )
        # Web pages are kept out (browsers.py) before anything else looks at a request.
        self._app = BrowserGuard(routes, browsers)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI application."""
        if scope["type"] == "http" and self.in_flight >= MAX_CONCURRENT_RPCS:
            # The bound gRPC has on requests served at once.
            status, body = domain_error(Unavailable("too many requests at once; retry"))
            await JSONResponse(body, status)(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in ("/health", "/ready"):  # probes: no line each
            await self._app(scope, receive, send)
            return
        # The access log's line (kvkeepd.api.access): handlers fill it in through request.state.
        access = Access("http", f"{scope['method']} {scope['path'][:200]}")
        scope.setdefault("state", {})["access"] = access
        answered = "-"

        async def send_noting_status(message: AsgiMessage) -> None:
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = str(message["status"])
            await send(message)

        self.in_flight += 1
        try:
            await self._app(scope, receive, send_noting_status)
        except asyncio.CancelledError:
            # NOTE: once the daemon stops, uvicorn cancels the requests that outlive the grace
            # period. The cancellation has passed through the request (its generation was
            # told to stop on the way) and ends the task here, where uvicorn would log it as
            # an application error.
            if self.accepting:
                raise
        finally:
            self.in_flight -= 1
            access.done(answered)

    # ---- plumbing ----------------------------------------------------------------------------

    def _endpoint(
        self,
        fn: Callable[[Request], Awaitable[Response]],
        prompt: str = "messages",
        fields: Mapping[str, str] | None = None,
    ) -> Callable[[Request], Awaitable[Response]]:
        """Errors of a handler as OpenAI error bodies (`prompt`: the field that a prompt
        beyond the context is blamed on; `fields`: the API's names of the session layer's
        fields, for `param`). The access log's line gets a refusal's code."""

        async def handle(request: Request) -> Response:
            try:
                return await fn(request)
            except KvkeepError as e:
                if type(e) is KvkeepError:
                    log.error("internal error", exc_info=e)
                status, body = domain_error(e, prompt)
                param = body["error"]["param"]
                body["error"]["param"] = (fields or {}).get(param, param)
                access(request).reason = body["error"]["code"] if status < 500 else ""
                return JSONResponse(body, status)
            except ValidationError as e:
                message, code, param = _describe(e)
                access(request).reason = code
                return JSONResponse(error("invalid_request_error", message, code, param), 400)
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

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error(kind, f"{request.method} {request.url.path}: {exc.detail}"), exc.status_code
        )

    def _tenant(self, request: Request) -> Tenant:
        if not self.accepting:
            raise Unavailable("the daemon is shutting down")
        tenant = self.manager.resolve_tenant(request.headers.get("authorization"))
        access(request).tenant = tenant.name
        return tenant

    async def _parse(self, request: Request, model: type[B]) -> B:
        body = await self._body(request)
        return await bulk.run(lambda: model.model_validate_json(body), large=len(body) > bulk.LARGE_BYTES)

    async def _body(self, request: Request) -> bytes:
        """The request's body, read within the body limit."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.body_limit:
            raise BodyTooLarge
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.body_limit:
                raise BodyTooLarge
        return bytes(body)

    # ---- models ------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in self.names]})

    async def model(self, request: Request) -> Response:
        self._tenant(request)
        if request.path_params["model_id"] not in self.names:
            raise NotFound(f"no model {request.path_params['model_id'][:80]!r}")
        return JSONResponse(self._model_card(request.path_params["model_id"]))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvkeep"}

    # ---- health ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """/health and /ready, as llama-server's: 200 while serving, 503 once stopping. Open
        to anyone (as a load balancer's probe is), and says nothing of tenants."""
        if not self.accepting:
            return JSONResponse(error("unavailable_error", "the daemon is shutting down"), 503)
        return JSONResponse({"status": "ok"})

    # ---- chat --------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        req = await self._parse(request, ChatCompletionRequest)
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

    # ---- legacy completions ------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        req = await self._parse(request, CompletionRequest)
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

    # ---- responses ---------------------------------------------------------------------------

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


def _describe(e: ValidationError) -> tuple[str, str, str | None]:
    """The first problem of a body, naming the field: the message, OpenAI's code for it and
    the top-level field (`param`)."""
    first = e.errors()[0]
    loc = first.get("loc", ())
    where = ".".join(str(p) for p in loc)
    if first.get("type") == "extra_forbidden":
        return f"unknown parameter {where[:80]!r}", "unknown_parameter", where or None
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return (
        f"{where + ': ' if where else ''}{first.get('msg', 'invalid body')}{more}",
        code,
        str(loc[0]) if loc else None,
    )
