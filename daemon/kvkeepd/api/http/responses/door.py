"""OpenAI's Responses API on the HTTP door: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`; and `GET /v1/responses`, the
caller's stored responses listed (a route OpenAI does not have), so that one whose ids were
lost can be deleted.

Handlers translate: a body in, the SessionManager's stored responses (sessions/flows/responses.py),
a body or a stream of events out. What is stored with a response is its response object and
input items as these handlers shape them (shapes.py), so a retrieval, a listing or
a replayed stream answers from the record alone. An input item that is an `item_reference`
stands for the output item of the tenant's stored response it names.

A response that stores nothing and continues no stored one (`store: false`, as Codex CLI
sends every turn) carries its whole conversation in its input: it is answered as the chat door
answers a conversation sent whole, in a session the door keeps (keep.py) under the tenant and
the request's `prompt_cache_key`, so that the next turn, which resends it, evaluates only what
is new; its leading system messages are kept in the durable store, for its first turn after a
restart.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvkeepd import bulk
from kvkeepd.api.http.body import parsed
from kvkeepd.api.http.handlers import Handlers
from kvkeepd.api.http.openai import domain_error
from kvkeepd.api.http.responses.schema import LOGPROBS, ResponseCreate, ResponseSpec
from kvkeepd.api.http.responses.shapes import ResponseShape, holder_of, listing, replay
from kvkeepd.api.http.sse import STREAM_HEADERS, beating
from kvkeepd.api.http.waiting import access, counted, unless_left
from kvkeepd.errors import InvalidRequest, KvkeepError, NoChatTemplate, NotFound
from kvkeepd.sessions.flows.response_list import PAGE as LISTED
from kvkeepd.sessions.flows.response_list import StoredResponse
from kvkeepd.sessions.flows.responses import ResponseRequest, new_response_id
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.values.generation import Chunk
from kvkeepd.values.messages import Message

log = logging.getLogger(__name__)

#: Input items a listing gives at most, and by default (OpenAI's bounds).
MAX_PAGE, PAGE = 100, 20
#: How long a named conversation's system prompt is kept: OpenAI's `prompt_cache_retention`,
#: an hour (its in-memory retention's longest) or a day ("24h").
HOUR, DAY = 3600.0, 86400.0


class ResponsesDoor(Handlers):
    """The Responses API's handlers (handlers.py says what they are given)."""

    async def create(self, request: Request) -> Response:
        tenant = self.tenant(request)
        raw = await self.body(request)

        large = len(raw) > bulk.LARGE_BYTES
        body = await parsed(raw, ResponseCreate)
        if isinstance(body.input, list) and any(i.get("type") == "item_reference" for i in body.input):
            body.input = await self._dereferenced(tenant, body.input)
        spec = await bulk.run(body.checked, large=large)
        if spec.ignored_tools:
            # Said where a client and an operator look: a header, and the access log.
            access(request).notes["ignored-tools"] = ",".join(spec.ignored_tools)
        shape = ResponseShape(new_response_id(), int(time.time()), self.model_id, body, spec)
        context_policy = "truncate" if body.truncation == "auto" else "error"
        if not spec.store and not body.previous_response_id:
            stream = counted(request, await self._sent_whole(request, tenant, body, spec, context_policy))
        else:
            wanted = ResponseRequest(
                response_id=shape.response_id,
                previous_response_id=body.previous_response_id or "",
                instructions=spec.instructions,
                messages=spec.messages,
                turn=spec.turn,
                store=spec.store,
                context_policy=context_policy,
                cache_salt=spec.cache_salt,
            )
            stream = counted(request, self.manager.answer(tenant, wanted, shape.document))
        if spec.stream:
            return await self._events(request, stream, shape)

        async def collect() -> list[Chunk]:
            return [c async for c in stream]

        chunks = await unless_left(request, collect())
        return JSONResponse(shape.response(chunks), headers=ignored_tools(spec))

    async def _dereferenced(self, tenant: Tenant, given: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The input with each `item_reference` replaced by the item it names: an output item
        of one of the tenant's stored responses (NotFound otherwise, another tenant's too)."""
        out: list[dict[str, Any]] = []
        held: dict[str, list[dict[str, Any]]] = {}
        for i, item in enumerate(given):
            if item.get("type") != "item_reference":
                out.append(item)
                continue
            item_id = item.get("id")
            if not isinstance(item_id, str) or set(item) - {"type", "id"}:
                raise InvalidRequest(f"input[{i}]: an item_reference has a type and an id (text)", "input")
            response_id = holder_of(item_id)
            if response_id is None:
                raise NotFound(f"no item {item_id[:80]!r}")
            if response_id not in held:
                try:
                    record = await self.manager.lookup_response(response_id, tenant)
                except NotFound:
                    raise NotFound(f"no item {item_id[:80]!r}") from None
                held[response_id] = record.document["response"]["output"]
            found = [o for o in held[response_id] if o.get("id") == item_id]
            if not found:
                raise NotFound(f"no item {item_id[:80]!r}")
            out.append(found[0])
        return out

    async def _sent_whole(
        self, request: Request, tenant: Tenant, body: ResponseCreate, spec: ResponseSpec, context_policy: str
    ) -> AsyncIterator[Chunk]:
        """The reply to a conversation sent whole and stored nowhere, in the session kept
        for it under the tenant and its prompt_cache_key."""
        if self.manager.template is None:
            raise NoChatTemplate("the model has no chat template; use /v1/completions")
        if not spec.messages:
            raise InvalidRequest(
                "the input is empty: give at least one item, or previous_response_id", "input"
            )
        lead = [Message("system", spec.instructions)] if spec.instructions is not None else []
        conversation = [*lead, *spec.messages]
        session_id, stream, continued = await self.keep.converse(
            tenant,
            conversation,
            spec.turn,
            key=body.prompt_cache_key or "",
            cache_salt=spec.cache_salt,
            context_policy=context_policy,
        )
        access(request).session = session_id
        system = list(itertools.takewhile(lambda m: m.role == "system", conversation))
        if continued or not body.prompt_cache_key or not system or len(system) == len(conversation):
            return stream
        # A named conversation's leading system messages (the agent's instructions and tools,
        # the bulk of its every prompt) are kept in the durable store, where the prefix cache
        # finds them: its first turn after a restart, or once its session was let go, reads
        # them instead of evaluating them. Kept again, nothing new is stored.
        ttl = DAY if body.prompt_cache_retention == "24h" else HOUR
        return self._then_keep(stream, tenant, session_id, system, ttl)

    async def _then_keep(
        self, stream: AsyncIterator[Chunk], tenant: Tenant, session_id: str, prefix: list[Message], ttl: float
    ) -> AsyncIterator[Chunk]:
        """The reply; before its end, the conversation's state at the end of `prefix` is kept
        for `ttl` seconds (a failure, the tenant's quota say, costs the reply nothing)."""
        async for chunk in stream:
            if chunk.finish_reason not in (None, "cancelled"):
                try:
                    await self.manager.keep_prefixes(session_id, tenant, [prefix], ttl)
                except KvkeepError as e:
                    log.info("the system prompt of session %s was not kept: %s", session_id, e)
            yield chunk

    async def _events(self, request: Request, stream: AsyncIterator[Chunk], shape: ResponseShape) -> Response:
        it = aiter(stream)
        # The first chunk (the prompt's first progress report, as its evaluation begins)
        # before the response starts: errors until then get their status.
        first = await unless_left(request, anext(it))

        async def events() -> AsyncGenerator[bytes, None]:
            chunks: list[Chunk] = []
            try:
                for e in shape.opening():
                    yield e
                # While the prompt is evaluated, and whenever else nothing is said for a while,
                # a heartbeat: response.in_progress again.
                async with contextlib.aclosing(beating(first, it, self.heartbeat)) as beats:
                    async for chunk in beats:
                        if chunk is None:
                            yield shape.heartbeat()
                        elif chunk.progress is None:
                            chunks.append(chunk)
                            for e in shape.delta(chunk):
                                yield e
                            if chunk.finish_reason is not None:
                                break
                for e in shape.closing(chunks):
                    yield e
            except Exception as e:
                if not isinstance(e, KvkeepError) or type(e) is KvkeepError:
                    log.error("internal error", exc_info=e)
                _, error = domain_error(e if isinstance(e, KvkeepError) else KvkeepError(), "input")
                for ev in shape.failure(error["error"]["code"], error["error"]["message"]):
                    yield ev
            finally:
                # A client that left stops the generation (within one engine step).
                if isinstance(it, AsyncGenerator):
                    await it.aclose()

        headers = {**STREAM_HEADERS, **ignored_tools(shape.spec)}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def retrieve(self, request: Request) -> Response:
        tenant = self.tenant(request)
        query = request.query_params
        for name in [*query.getlist("include"), *query.getlist("include[]")]:
            if name != LOGPROBS:
                raise InvalidRequest(f"include {name[:80]!r} is not supported: only {LOGPROBS!r}")
        stream = _flag(query.get("stream"), "stream")
        after = _number(query.get("starting_after"), "starting_after", -1)
        record = await self.manager.lookup_response(request.path_params["response_id"], tenant)
        if stream:
            return StreamingResponse(
                _aiter(replay(record.document, after)), media_type="text/event-stream", headers=STREAM_HEADERS
            )
        return JSONResponse(record.document["response"])

    async def delete(self, request: Request) -> Response:
        tenant = self.tenant(request)
        response_id = request.path_params["response_id"]
        await self.manager.delete_response(response_id, tenant)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def listing(self, request: Request) -> Response:
        """`GET /v1/responses`: the caller's stored responses, a page at a time, in the shape
        of OpenAI's list endpoints (`limit`, `after`, `order`)."""
        tenant = self.tenant(request)
        query = request.query_params
        page = await self.manager.list_responses(
            tenant,
            after=query.get("after", ""),
            limit=_number(query.get("limit"), "limit", LISTED),
            order=query.get("order", "desc"),
        )
        data = [_summary(r) for r in page.responses]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": page.has_more,
            }
        )

    async def input_items(self, request: Request) -> Response:
        tenant = self.tenant(request)
        query = request.query_params
        limit = _number(query.get("limit"), "limit", PAGE)
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidRequest(f"limit must be in [1, {MAX_PAGE}]")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be asc or desc")
        record = await self.manager.lookup_response(request.path_params["response_id"], tenant)
        items: list[dict[str, Any]] = record.document["input"]
        return JSONResponse(listing(items, after=query.get("after", ""), limit=limit, order=order))


def _summary(r: StoredResponse) -> dict[str, Any]:
    """A listed response: its id and what it holds (GET /v1/responses/{id} gives it whole)."""
    return {
        "id": r.response_id,
        "object": "response",
        "created_at": int(r.created_at),
        "previous_response_id": r.previous_response_id or None,
        "expires_at": int(r.expires_at) if r.expires_at else None,
        "n_tokens": r.n_tokens,
        "bytes_written": r.bytes_written,
        "bytes_referenced": r.bytes_referenced,
    }


def _flag(value: str | None, name: str) -> bool:
    if value in (None, "", "false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise InvalidRequest(f"{name} must be true or false")


def _number(value: str | None, name: str, default: int) -> int:
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer") from None


async def _aiter(events: Any) -> AsyncGenerator[bytes, None]:
    for e in events:
        yield e


#: The header that names the hosted tools a request gave and the model was not shown.
IGNORED_TOOLS_HEADER = "x-kvkeep-ignored-tools"


def ignored_tools(spec: ResponseSpec) -> dict[str, str]:
    """The response's header naming the hosted tools left out (none: no header)."""
    return {IGNORED_TOOLS_HEADER: ",".join(spec.ignored_tools)} if spec.ignored_tools else {}
