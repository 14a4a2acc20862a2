"""The console's routes on the HTTP door: its page and files at `/` and `/console/`, and the
JSON routes under `/console/api/` that the page (or any client with a token) calls.

Reading routes answer under the API's auth, each for the caller's tenant alone (another
tenant's session or checkpoint is 404, as on every route). Acting routes (create, checkpoint,
restore, fork, close, delete) each make one SessionManager call, but a fork at a message
("branch here"): a fork, then a rewind of the fork to that message's end. With
`--console read-only` they answer 403 before anything else. The page and its files are the
same for everyone and carry no data: they are served without a token, with a
Content-Security-Policy that lets the page run its own scripts alone.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvkeepd import __version__
from kvkeepd.api.http.body import Body
from kvkeepd.api.http.console import shapes
from kvkeepd.api.http.openai import error
from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.flows.responses import RESPONSE_ID_PREFIX, checkpoint_of
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.values.messages import ChatMessage
from kvkeepd.values.sampling import SamplingOverrides

#: `--console` values.
ON, READ_ONLY, OFF = "on", "read-only", "off"
# The page's files, by name; their types.
_FILE = re.compile(r"^[a-z]+\.(html|js|css|svg)$")
_TYPES = {
    "html": "text/html; charset=utf-8",
    "js": "text/javascript; charset=utf-8",
    "css": "text/css; charset=utf-8",
    "svg": "image/svg+xml",
}
# The page runs its own files alone: model output that slipped into markup would still not run.
_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

Handler = Callable[[Request], Awaitable[Response]]


def page_files() -> dict[str, bytes]:
    """The console's files as the package ships them (`static/`), by name."""
    folder = resources.files("kvkeepd.api.http.console") / "static"
    return {f.name: f.read_bytes() for f in folder.iterdir() if _FILE.match(f.name)}


class CreateBody(Body):
    system_prompt: str = ""
    persistent: bool = False


class CheckpointBody(Body):
    label: str = ""


class RestoreBody(Body):
    checkpoint_id: str


class ForkBody(Body):
    session_id: str = ""
    checkpoint_id: str = ""
    persistent: bool = False
    # Set: the fork holds its source's conversation through this message (0: the first).
    through_message: int | None = None


class Console:
    """The console over a SessionManager: `routes` gives its routes, each wrapped by the
    door's `endpoint` (its errors as the API's error bodies)."""

    def __init__(
        self,
        manager: SessionManager,
        mode: str,
        model_id: str,
        *,
        tenant: Callable[[Request], Tenant],
        body: Callable[[Request], Awaitable[bytes]],
    ) -> None:
        self.manager = manager
        self.mode = mode
        self.model_id = model_id
        self.tenant = tenant
        self.body = body
        self.files = page_files()

    def routes(self, endpoint: Callable[[Handler], Handler]) -> list[Route]:
        api = "/console/api"
        session = api + "/sessions/{session_id}"
        checkpoint = api + "/checkpoints/{checkpoint_id}"
        reading: list[tuple[str, Handler]] = [
            (api + "/info", self.info),
            (api + "/sessions", self.sessions),
            (session, self.session_tree),
            (api + "/responses", self.responses),
            (checkpoint + "/messages", self.checkpoint_messages),
            (checkpoint + "/export", self.export),
        ]
        acting: list[tuple[str, str, Handler]] = [
            (api + "/sessions", "POST", self.create),
            (session + "/checkpoints", "POST", self.checkpoint),
            (session + "/restore", "POST", self.restore),
            (api + "/forks", "POST", self.fork),
            (session, "DELETE", self.close),
            (checkpoint, "DELETE", self.delete_checkpoint),
        ]
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/console/{name}", self.page, methods=["GET"]),
            *(Route(path, endpoint(fn), methods=["GET"]) for path, fn in reading),
            *(Route(path, endpoint(self._acting(fn)), methods=[method]) for path, method, fn in acting),
        ]

    def _acting(self, fn: Handler) -> Handler:
        async def act(request: Request) -> Response:
            self.tenant(request)  # who asks comes first: 401 before 403
            if self.mode == READ_ONLY:
                message = "the console is read-only (--console read-only): it does not act on sessions"
                return JSONResponse(error("permission_error", message, "console_read_only"), 403)
            return await fn(request)

        return act

    # ---- the page ----------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        name = request.path_params.get("name", "index.html")
        data = self.files.get(name)
        if data is None:
            return JSONResponse(error("not_found_error", f"no console file {name[:80]!r}"), 404)
        kind = _TYPES[name.rpartition(".")[2]]
        return Response(data, media_type=kind, headers=_HEADERS)

    # ---- reading -----------------------------------------------------------------------------

    async def info(self, request: Request) -> Response:
        tenant = self.tenant(request)
        m = self.manager
        model = {
            "id": self.model_id,
            "description": m.model.description,
            "architecture": m.model.architecture,
            "n_ctx_train": m.model.n_ctx_train,
            "ctx_per_session": m.model.n_ctx_seq,
            "mode": "exact" if m.model.exact else "compact",
            "flash_attention": m.model.flash_attention,
            "kv_type": m.settings.kv_type,
            "has_chat_template": m.template is not None,
            "version": __version__,
        }
        counters = m.counters
        glance = shapes.glance(m.settings, model, m.tenant_counters(tenant), counters, tenant, self.mode)
        return JSONResponse(glance)

    async def sessions(self, request: Request) -> Response:
        tenant = self.tenant(request)
        m = self.manager
        views, rows = await m.listing(tenant)
        listed = [shapes.session_row(v) for v in views]
        heads = m.store_location(persistent=True)
        listed += [shapes.listed_row(r, heads, m.expires_at(True, r.last_used_at)) for r in rows]
        return JSONResponse({"object": "list", "data": sorted(listed, key=lambda s: s["created_at"])})

    async def session_tree(self, request: Request) -> Response:
        tenant = self.tenant(request)
        session_id = request.path_params["session_id"]
        m = self.manager
        view = await m.view(await m.find(session_id, tenant))
        rows = await m.list_checkpoints(session_id, tenant)
        sources = {session_id, *(r.checkpoint_id for r in rows)}
        views, _ = await m.listing(tenant)
        forks = [v for v in views if v.session.forked_from in sources]
        location = m.store_location(view.session.persistent)
        return JSONResponse(shapes.tree(view, rows, forks, location))

    async def responses(self, request: Request) -> Response:
        tenant = self.tenant(request)
        after = request.query_params.get("after", "")
        page = await self.manager.list_responses(tenant, after=after, limit=100, order="asc")
        location = self.manager.store_location(persistent=True)
        return JSONResponse(
            {
                "object": "list",
                "data": [shapes.response(r, location) for r in page.responses],
                "has_more": page.has_more,
            }
        )

    async def checkpoint_messages(self, request: Request) -> Response:
        """The conversation up to a checkpoint or a stored response (its id either way)."""
        tenant = self.tenant(request)
        messages = await self.manager.checkpoint_messages(_checkpoint_id(request), tenant)
        return JSONResponse({"object": "list", "data": [shapes.message(m) for m in messages]})

    async def export(self, request: Request) -> Response:
        """The checkpoint's export file (as `kvkeep export` writes it)."""
        tenant = self.tenant(request)
        checkpoint_id = _checkpoint_id(request)
        chunks = aiter(self.manager.export_checkpoint(checkpoint_id, tenant))
        first = await anext(chunks, b"")  # an unknown checkpoint is 404, before the file begins

        async def rest() -> AsyncIterator[bytes]:
            yield first
            async for chunk in chunks:
                yield chunk

        disposition = f'attachment; filename="{checkpoint_id}.kvkeep"'
        return StreamingResponse(
            rest(), media_type="application/octet-stream", headers={"content-disposition": disposition}
        )

    # ---- acting ------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        tenant = self.tenant(request)
        body = CreateBody.model_validate_json(await self.body(request) or b"{}")
        session = await self.manager.create_session(
            tenant, body.system_prompt, SamplingOverrides(), (), persistent=body.persistent
        )
        return await self._session(session.session_id, tenant, 201)

    async def checkpoint(self, request: Request) -> Response:
        tenant = self.tenant(request)
        body = CheckpointBody.model_validate_json(await self.body(request) or b"{}")
        row = await self.manager.checkpoint(request.path_params["session_id"], tenant, body.label)
        session = self.manager.get(row.session_id, tenant)
        location = self.manager.store_location(session.persistent)
        return JSONResponse(shapes.checkpoint(row, session.persistent, location), 201)

    async def restore(self, request: Request) -> Response:
        tenant = self.tenant(request)
        body = RestoreBody.model_validate_json(await self.body(request))
        session, reprefilled = await self.manager.restore(
            request.path_params["session_id"], body.checkpoint_id, tenant
        )
        row = shapes.session_row(await self.manager.view(session))
        return JSONResponse(row | {"reprefilled": reprefilled})

    async def fork(self, request: Request) -> Response:
        tenant = self.tenant(request)
        body = ForkBody.model_validate_json(await self.body(request))
        checkpoint_id = body.checkpoint_id
        if checkpoint_id.startswith(RESPONSE_ID_PREFIX):
            checkpoint_id = checkpoint_of(checkpoint_id)
        session, reprefilled = await self.manager.fork(
            body.session_id, checkpoint_id, body.persistent, tenant
        )
        if body.through_message is not None:
            await self._cut(session.session_id, tenant, body.through_message)
        return await self._session(session.session_id, tenant, 201, {"reprefilled": reprefilled})

    async def _cut(self, fork_id: str, tenant: Tenant, through: int) -> None:
        """Rewind a new fork to the end of its message `through`; a message it cannot end
        at closes the fork (nobody has learnt its id) and is a 400."""
        view = await self.manager.view(await self.manager.find(fork_id, tenant))
        try:
            n_tokens = branch_point(view.session.messages, through, view.n_tokens)
            if n_tokens < view.n_tokens:
                await self.manager.rewind(fork_id, tenant, n_tokens)
        except BaseException:
            await self.manager.close_session(fork_id, tenant)
            raise

    async def close(self, request: Request) -> Response:
        tenant = self.tenant(request)
        session_id = request.path_params["session_id"]
        await self.manager.close_session(session_id, tenant)
        return JSONResponse({"session_id": session_id, "deleted": True})

    async def delete_checkpoint(self, request: Request) -> Response:
        tenant = self.tenant(request)
        checkpoint_id = request.path_params["checkpoint_id"]
        await self.manager.delete_checkpoint(checkpoint_id, tenant)
        return JSONResponse({"checkpoint_id": checkpoint_id, "deleted": True})

    async def _session(
        self, session_id: str, tenant: Tenant, status: int, extra: dict[str, Any] | None = None
    ) -> Response:
        view = await self.manager.view(await self.manager.find(session_id, tenant))
        return JSONResponse(shapes.session_row(view) | (extra or {}), status)


def branch_point(messages: Sequence[ChatMessage], through: int, n_tokens: int) -> int:
    """The length of a history of `n_tokens` that holds `messages[: through + 1]` and
    nothing after them: where the next message's tokens begin. Messages added in one turn
    share where they begin, so only the last of them is a place to end."""
    if not 0 <= through < len(messages):
        raise InvalidRequest(
            f"through_message must be in [0, {len(messages) - 1}], got {through}", "through_message"
        )
    if through == len(messages) - 1:
        return n_tokens
    end = messages[through + 1].start
    if end <= messages[through].start:
        raise InvalidRequest(
            f"messages {through} and {through + 1} were added in one turn: a fork ends after the turn's last",
            "through_message",
        )
    return end


def _checkpoint_id(request: Request) -> str:
    """The route's checkpoint id; a stored response's id names its checkpoint."""
    given = str(request.path_params["checkpoint_id"])
    return checkpoint_of(given) if given.startswith(RESPONSE_ID_PREFIX) else given
