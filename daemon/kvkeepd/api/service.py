"""The gRPC servicer: protobuf in, a domain call, protobuf out; errors to status codes.

Nothing else happens here. Each handler is a translation; the work is in SessionManager.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeepd import __version__, bulk
from kvkeepd.api.access import Access
from kvkeepd.api.convert import (
    checkpoint_to_pb,
    chunk_to_pb,
    device_fields,
    listed_to_pb,
    message_from_pb,
    overrides_from_pb,
    response_to_pb,
    session_to_pb,
    tools_from_pb,
    turn_from_pb,
)
from kvkeepd.api.wire import Requests
from kvkeepd.errors import CAUSE_KEY, INTERNAL_CAUSE, RETRY_KEY, InvalidRequest, KvkeepError, Unavailable
from kvkeepd.sessions.flows.response_list import PAGE
from kvkeepd.sessions.manager import SessionManager, SessionView
from kvkeepd.sessions.tenants import Tenant

log = logging.getLogger(__name__)

Resp = TypeVar("Resp")

#: The metadata key a client names the session of its call in; a proxy in front of several
#: daemons routes by it (deploy/haproxy.cfg). CreateSession and ForkSession answer with the
#: new session's id under the same key, so the proxy learns where the session lives.
SESSION_HEADER = "x-kvkeep-session"


def _check_routing(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """A call routed by one session must be about that session: where the request names a
    session and the metadata another, the proxy sent it to the other's daemon, so refuse it
    (a request that names none, such as a fork of a checkpoint, may be routed by any)."""
    session_id = getattr(request, "session_id", "")
    if not session_id:
        return
    routed = next((v for k, v in context.invocation_metadata() or () if k == SESSION_HEADER), None)
    if routed is not None and routed != session_id:
        raise InvalidRequest(
            f"the {SESSION_HEADER} metadata names another session ({str(routed)[:80]!r}) than the request"
        )


async def send_session_header(context: grpc.aio.ServicerContext[Any, Any], session_id: str) -> None:
    """Name a session that this call made in the response's metadata."""
    await context.send_initial_metadata(((SESSION_HEADER, session_id),))


async def _abort(context: grpc.aio.ServicerContext[Any, Any], error: BaseException) -> None:
    if isinstance(error, KvkeepError) and type(error) is not KvkeepError:
        # Errors that share a status say which cause they are (see errors.py).
        cause: tuple[tuple[str, str], ...] = ((CAUSE_KEY, error.cause),) if error.cause else ()
        if error.retry_after_ms:
            cause += ((RETRY_KEY, str(error.retry_after_ms)),)
        await context.abort(grpc.StatusCode[error.code], str(error), trailing_metadata=cause)
    log.error("internal error", exc_info=error)
    # Named as the daemon's own: gRPC reports some broken connections as INTERNAL too (a
    # proxy's stream cut short), which a client may send again; never this one.
    internal = ((CAUSE_KEY, INTERNAL_CAUSE),)
    await context.abort(
        grpc.StatusCode.INTERNAL, "internal error (see the daemon's log)", trailing_metadata=internal
    )


#: A handler: the service, its request (decoded), the caller's tenant, the call's context.
Handler = Callable[[Any, Any, Tenant, Any], Resp]


def unary(fn: Handler[Awaitable[Resp]]) -> Callable[[KvKeepService, Any, Any], Awaitable[Resp]]:
    """A unary (or client-streaming) handler over its request's bytes (KvKeepService.admit),
    its domain errors mapped to gRPC statuses."""

    @functools.wraps(fn)
    async def wrapper(self: KvKeepService, received: Any, context: Any) -> Resp:
        access = Access("grpc", fn.__name__)
        status = "CANCELLED"
        try:
            tenant, request = self.admit(fn.__name__, received, context)
            access.tenant, access.session = tenant.name, getattr(request, "session_id", "")
            response = await fn(self, request, tenant, context)
            session = getattr(response, "session", None)
            access.session = access.session or getattr(session, "session_id", "")
            status = "OK"
            return response
        except Exception as e:
            status = _status(e)
            await _abort(context, e)
            raise  # unreachable: abort raises
        finally:
            access.done(status)

    return wrapper


def streaming(
    fn: Handler[AsyncGenerator[Resp, None]],
) -> Callable[[KvKeepService, Any, Any], AsyncGenerator[Resp, None]]:
    """A server-streaming handler over its request's bytes (KvKeepService.admit), its
    domain errors mapped to gRPC statuses."""

    @functools.wraps(fn)
    async def wrapper(self: KvKeepService, received: Any, context: Any) -> AsyncGenerator[Resp, None]:
        access = Access("grpc", fn.__name__)
        status = "CANCELLED"
        try:
            tenant, request = self.admit(fn.__name__, received, context)
            access.tenant, access.session = tenant.name, getattr(request, "session_id", "")
            async with contextlib.aclosing(fn(self, request, tenant, context)) as stream:
                async for item in stream:
                    chunk = getattr(item, "chunk", None)
                    if chunk is not None and chunk.HasField("usage"):
                        access.tokens(chunk.usage.prompt_tokens, chunk.usage.generated_tokens)
                    yield item
            status = "OK"
        except Exception as e:
            status = _status(e)
            await _abort(context, e)
        finally:
            access.done(status)

    return wrapper


def _status(error: BaseException) -> str:
    """The status a failed call ends with, as the access log names it."""
    return error.code if isinstance(error, KvkeepError) and type(error) is not KvkeepError else "INTERNAL"


class KvKeepService:
    """The kvkeep.v1.KvKeep service over a SessionManager; server.add_service serves it."""

    def __init__(
        self,
        manager: SessionManager,
        model_path: str,
        fingerprint: str,
        http_address: str = "",
        metrics_address: str = "",
    ) -> None:
        self.manager = manager
        self.model_path = model_path
        self.fingerprint = fingerprint
        # Where the other doors listen ("" where off), for GetInfo.
        self.http_address = http_address
        self.metrics_address = metrics_address
        self.accepting = True
        self.requests = Requests(
            prompt_limit=manager.settings.prompt_limit,
            max_token_bytes=manager.model.max_token_bytes,
            max_message_bytes=manager.settings.max_message_bytes,
        )

    def admit(self, method: str, received: bytes | AsyncIterator[bytes], context: Any) -> tuple[Tenant, Any]:
        """The caller's tenant and its request: authentication first, on every method, before
        anything of the request is read; then the request decoded within its method's bounds
        (wire.py) and its routing checked (a client stream's requests are decoded as read)."""
        tenant = self.tenant(context)
        if not isinstance(received, bytes):
            return tenant, self.requests.stream(method, received)
        request = self.requests.decode(method, received)
        _check_routing(request, context)
        return tenant, request

    def tenant(self, context: Any) -> Tenant:
        """The caller's tenant, from its bearer token; Unauthenticated if it has none."""
        metadata = context.invocation_metadata() or ()
        authorization = next((v for k, v in metadata if k == "authorization"), None)
        return self.manager.resolve_tenant(authorization if isinstance(authorization, str) else None)

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise Unavailable("the daemon is shutting down")

    @unary
    async def GetInfo(self, request: pb.GetInfoRequest, tenant: Tenant, context: Any) -> pb.GetInfoResponse:
        m = self.manager
        c = m.tenant_counters(tenant)
        t = c.tally
        return pb.GetInfoResponse(
            version=__version__,
            # A multi-tenant daemon shows callers no paths of its machine.
            model_path="" if m.tenants.authenticated else self.model_path,
            model_fingerprint=self.fingerprint,
            model_description=m.model.description,
            n_vocab=m.model.n_vocab,
            n_ctx_train=m.model.n_ctx_train,
            slots=m.settings.slots,
            ctx_per_session=m.model.n_ctx_seq,
            kv_type=m.settings.kv_type,
            mode="exact" if m.model.exact else "compact",
            has_chat_template=m.template is not None,
            slots_in_use=c.slots_in_use,
            sessions=c.sessions,
            sessions_hot=c.hot,
            sessions_warm=c.warm,
            sessions_cold=c.cold,
            tokens_reused=t.tokens_reused,
            tokens_evaluated=t.tokens_evaluated,
            tokens_generated=t.tokens_generated,
            swap_ins=t.swap_ins,
            swap_in_seconds_total=t.swap_in_seconds,
            max_prompt_tokens=m.settings.prompt_limit,
            block_tokens=m.settings.block_tokens,
            architecture=m.model.architecture,
            memory_type=m.model.memory,
            checkpoints_carry_state=m.model.layout is not None,
            state_note=m.model.layout_note,
            mode_note=m.model.exact_note,
            flash_attention=m.model.flash_attention,
            attention_note=m.model.flash_note,
            response_ttl_seconds=m.settings.response_ttl,
            gpu_layers=m.settings.gpu_layers,
            docks=m.engine.streams.docks,
            sessions_docked=c.docked,
            kv_stream_bytes=m.engine.streams.stream_bytes,
            pinned_transfers=m.engine.pinned,
            **device_fields(m.engine.devices),
            tool_format=m.template.toolkit.format if m.template is not None else "",
            http_address=self.http_address,
            metrics_address=self.metrics_address,
        )

    @unary
    async def CreateSession(
        self, request: pb.CreateSessionRequest, tenant: Tenant, context: Any
    ) -> pb.CreateSessionResponse:
        self._check_accepting()
        session = await self.manager.create_session(
            tenant,
            cache_salt=request.cache_salt,
            system_prompt=request.system_prompt,
            sampling=overrides_from_pb(request.sampling),
            stop=list(request.stop),
            persistent=request.persistent,
            context_policy=request.context_policy,
            tools=tools_from_pb(request.tools),
        )
        await send_session_header(context, session.session_id)
        return pb.CreateSessionResponse(session=self._session_pb(await self.manager.view(session)))

    @unary
    async def GetSession(
        self, request: pb.GetSessionRequest, tenant: Tenant, context: Any
    ) -> pb.GetSessionResponse:
        session = await self.manager.find(request.session_id, tenant)
        return pb.GetSessionResponse(session=self._session_pb(await self.manager.view(session)))

    @unary
    async def ListSessions(
        self, request: pb.ListSessionsRequest, tenant: Tenant, context: Any
    ) -> pb.ListSessionsResponse:
        m = self.manager
        views, rows = await m.listing(tenant)
        n_ctx, heads = m.model.n_ctx_seq, m.store_location(persistent=True)
        found = [(v.session.created_at, self._session_pb(v)) for v in views]
        found += [
            (r.created_at, listed_to_pb(r, n_ctx, heads, m.expires_at(True, r.last_used_at))) for r in rows
        ]
        return pb.ListSessionsResponse(sessions=[info for _, info in sorted(found, key=lambda f: f[0])])

    @unary
    async def CloseSession(
        self, request: pb.CloseSessionRequest, tenant: Tenant, context: Any
    ) -> pb.CloseSessionResponse:
        await self.manager.close_session(request.session_id, tenant)
        return pb.CloseSessionResponse()

    @unary
    async def Rewind(self, request: pb.RewindRequest, tenant: Tenant, context: Any) -> pb.RewindResponse:
        self._check_accepting()
        session = await self.manager.rewind(request.session_id, tenant, request.n_tokens)
        return pb.RewindResponse(session=self._session_pb(await self.manager.view(session)))

    @streaming
    async def Generate(
        self, request: pb.GenerateRequest, tenant: Tenant, context: Any
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        self._check_accepting()
        stream = self.manager.generate(
            request.session_id,
            tenant,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            parse_special=request.parse_special,
            turn=turn_from_pb(request),
        )
        async for chunk in stream:
            yield pb.GenerateResponse(chunk=chunk_to_pb(chunk))

    @streaming
    async def Chat(
        self, request: pb.ChatRequest, tenant: Tenant, context: Any
    ) -> AsyncGenerator[pb.ChatResponse, None]:
        self._check_accepting()
        turn = turn_from_pb(request)
        if request.messages:
            if request.message:
                raise InvalidRequest("give a message or messages, not both")
            messages = await bulk.run(
                lambda: [message_from_pb(m) for m in request.messages],
                large=len(request.messages) > bulk.LARGE_MESSAGES,
            )
            stream = self.manager.converse(
                request.session_id, tenant, messages=messages, whole=request.whole, turn=turn
            )
        else:
            stream = self.manager.chat(request.session_id, tenant, message=request.message, turn=turn)
        async for chunk in stream:
            yield pb.ChatResponse(chunk=chunk_to_pb(chunk))

    @unary
    async def Checkpoint(
        self, request: pb.CheckpointRequest, tenant: Tenant, context: Any
    ) -> pb.CheckpointResponse:
        self._check_accepting()
        row = await self.manager.checkpoint(request.session_id, tenant, request.label)
        return pb.CheckpointResponse(checkpoint=checkpoint_to_pb(row))

    @unary
    async def ListCheckpoints(
        self, request: pb.ListCheckpointsRequest, tenant: Tenant, context: Any
    ) -> pb.ListCheckpointsResponse:
        rows = await self.manager.list_checkpoints(request.session_id, tenant)
        return pb.ListCheckpointsResponse(checkpoints=[checkpoint_to_pb(r) for r in rows])

    @unary
    async def RestoreCheckpoint(
        self, request: pb.RestoreCheckpointRequest, tenant: Tenant, context: Any
    ) -> pb.RestoreCheckpointResponse:
        self._check_accepting()
        session, reprefilled = await self.manager.restore(request.session_id, request.checkpoint_id, tenant)
        view = await self.manager.view(session)
        return pb.RestoreCheckpointResponse(session=self._session_pb(view), reprefilled=reprefilled)

    @unary
    async def ForkSession(
        self, request: pb.ForkSessionRequest, tenant: Tenant, context: Any
    ) -> pb.ForkSessionResponse:
        self._check_accepting()
        session, reprefilled = await self.manager.fork(
            request.session_id, request.checkpoint_id, request.persistent, tenant
        )
        await send_session_header(context, session.session_id)
        view = await self.manager.view(session)
        return pb.ForkSessionResponse(session=self._session_pb(view), reprefilled=reprefilled)

    @unary
    async def DeleteCheckpoint(
        self, request: pb.DeleteCheckpointRequest, tenant: Tenant, context: Any
    ) -> pb.DeleteCheckpointResponse:
        await self.manager.delete_checkpoint(request.checkpoint_id, tenant)
        return pb.DeleteCheckpointResponse()

    @streaming
    async def ExportCheckpoint(
        self, request: pb.ExportCheckpointRequest, tenant: Tenant, context: Any
    ) -> AsyncGenerator[pb.ExportCheckpointResponse, None]:
        async for data in self.manager.export_checkpoint(request.checkpoint_id, tenant):
            yield pb.ExportCheckpointResponse(data=data)

    @unary
    async def ImportCheckpoint(
        self, requests: AsyncIterator[pb.ImportCheckpointRequest], tenant: Tenant, context: Any
    ) -> pb.ImportCheckpointResponse:
        self._check_accepting()

        async def data() -> AsyncIterator[bytes]:
            async for request in requests:
                yield request.data

        row = await self.manager.import_checkpoint(data(), tenant)
        return pb.ImportCheckpointResponse(checkpoint=checkpoint_to_pb(row))

    @unary
    async def ListResponses(
        self, request: pb.ListResponsesRequest, tenant: Tenant, context: Any
    ) -> pb.ListResponsesResponse:
        page = await self.manager.list_responses(
            tenant,
            after=request.after,
            limit=request.limit or PAGE,
            order=request.order or "desc",
        )
        return pb.ListResponsesResponse(
            responses=[response_to_pb(r) for r in page.responses], has_more=page.has_more
        )

    @unary
    async def DeleteResponse(
        self, request: pb.DeleteResponseRequest, tenant: Tenant, context: Any
    ) -> pb.DeleteResponseResponse:
        await self.manager.delete_response(request.response_id, tenant)
        return pb.DeleteResponseResponse()

    def _session_pb(self, view: SessionView) -> pb.SessionInfo:
        return session_to_pb(view, self.manager.model.n_ctx_seq)
