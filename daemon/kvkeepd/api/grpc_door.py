"""The gRPC door: a server with the KvKeep service, health and reflection, bound to the
address the settings give (`--host`/`--port` or `--address`), TLS where configured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # stubs lack it
from grpc_reflection.v1alpha import reflection

from kvkeepd.api.service import KvKeepService
from kvkeepd.api.wire import SERVICE
from kvkeepd.config.settings import Settings
from kvkeepd.request_limits import MAX_CONCURRENT_RPCS, MAX_STREAMS_PER_CONNECTION

SERVICE_NAME = SERVICE.full_name
#: What to change when the gRPC door's address cannot be listened on.
GRPC_CHANGE = "choose another with --port (or --address)"

_HANDLERS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from the settings' PEM files (mutual TLS with a client CA), or None."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def add_service(server: grpc.aio.Server, service: KvKeepService) -> None:
    """Serve each method of the KvKeep service by the service's method of its name, which
    takes its request's bytes: no deserializer, so that nothing of a request is parsed before
    its caller is authenticated, and then only within its method's bounds (wire.py)."""
    handlers = {
        m.name: _HANDLERS[m.client_streaming, m.server_streaming](
            getattr(service, m.name), response_serializer=GetMessageClass(m.output_type).SerializeToString
        )
        for m in SERVICE.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def build_server(
    settings: Settings, service: KvKeepService, credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
    """A gRPC server with the service, health and reflection, bound but not started.

    Returns (server, health servicer, bound port; 0 for a unix socket).
    """
    limit = settings.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            # Dead peers are found (a ping every minute, 20 s to answer) and idle connections
            # closed after 30 minutes; clients may not ping more often than every 10 s.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.max_connection_idle_ms", 30 * 60_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 3),
            # Flow-control windows stay at their default: grown by BDP probing, they let
            # gRPC buffer megabytes of a slow import's unread chunks per stream (measured:
            # 10 parallel 150 MB imports grew RSS by 83-305 MiB with it, 29-33 MiB without).
            ("grpc.http2.bdp_probe", 0),
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    add_service(server, service)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    try:
        if credentials is not None:
            port = server.add_secure_port(settings.grpc_listen, credentials)
        else:
            port = server.add_insecure_port(settings.grpc_listen)
    except RuntimeError:  # gRPC's "Failed to bind"; its own log line says why
        port = 0
    if port == 0 and not settings.grpc_listen.startswith("unix:"):
        raise OSError(f"cannot listen on {settings.grpc_listen} (gRPC); {GRPC_CHANGE}")
    return server, health_servicer, port
