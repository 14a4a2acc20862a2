"""The HTTP door's application: each API's routes (chat/, responses/, anthropic/, console/)
and what they share, /v1/models, /health and /ready.

Each API's door translates, as the gRPC servicer does: a body in, a call to the
SessionManager's flows, a body (or a stream of server-sent events) out. Here callers are
resolved by the same `Tenants.resolve` as gRPC callers, bodies are read within the door's
limit, errors are OpenAI-style JSON bodies whose HTTP status follows the error table
(docs/errors.md), requests served at once are bounded and each gets its access log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message as AsgiMessage
from starlette.types import Receive, Scope, Send

from kvkeepd.api.access import Access
from kvkeepd.api.http.anthropic.door import MessagesDoor
from kvkeepd.api.http.body import BodyTooLarge, read_body
from kvkeepd.api.http.browsers import BrowserGuard, BrowserPolicy
from kvkeepd.api.http.chat.door import ChatDoor
from kvkeepd.api.http.console.routes import OFF, Console
from kvkeepd.api.http.keep import SessionKeep
from kvkeepd.api.http.openai import domain_error, error
from kvkeepd.api.http.responses.door import ResponsesDoor
from kvkeepd.api.http.waiting import access, client_closed
from kvkeepd.errors import KvkeepError, NotFound, Unavailable
from kvkeepd.request_limits import MAX_CONCURRENT_RPCS
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.tenants import Tenant

log = logging.getLogger(__name__)


class OpenAiDoor:
    """The door's application over a SessionManager: each API's handlers (`chat`,
    `responses`, `messages`, the console) behind its routes, a stream of any of them sending
    a heartbeat once it has said nothing for `heartbeat` seconds (sse.beating); `asgi` is
    the ASGI application."""

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
        #: What /v1/models lists: the model's id, then other names it goes by. A request may
        #: name any model: one is served.
        self.names = (model_id, *(a for a in aliases if a != model_id))
        self.body_limit = body_limit
        self.keep = SessionKeep(manager)
        self.accepting = True
        self.in_flight = 0
        self.created = int(time.time())
        self.chat = ChatDoor(
            manager, model_id, self.keep, tenant=self._tenant, body=self._body, heartbeat=heartbeat
        )
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
                Route("/v1/chat/completions", self._endpoint(self.chat.chat_completions), methods=["POST"]),
                Route("/v1/messages", self.messages.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.messages.count_tokens, methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.chat.completions, "prompt"), methods=["POST"]),
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

    async def _body(self, request: Request) -> bytes:
        """The request's body, read within the body limit."""
        return await read_body(request, self.body_limit)

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
