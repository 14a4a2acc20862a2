"""Server bootstrap: engine, session manager, gRPC server with health and reflection,
signals and an ordered, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstash.v1 import kvstash_pb2 as pb
from kvstash.v1 import kvstash_pb2_grpc as pb_grpc
from kvstashd.config import Settings
from kvstashd.engine import Engine, EngineConfig
from kvstashd.model import fingerprint
from kvstashd.service import KvStashService
from kvstashd.sessions import SessionManager

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvStash"].full_name


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(
        model_path=settings.model_path,
        slots=settings.slots,
        ctx_per_session=settings.ctx_per_session,
        batch_size=settings.batch_size,
        threads=settings.threads,
        gpu_layers=settings.gpu_layers,
        kv_type=settings.kv_type,
        kv_unified=settings.kv_unified,
    )


def build_server(
    settings: Settings, service: KvStashService
) -> tuple[grpc.aio.Server, health.HealthServicer, int]:
    """A gRPC server with the service, health and reflection, bound but not started.

    Returns (server, health servicer, bound port; 0 for a unix socket).
    """
    limit = settings.max_message_bytes
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_KvStashServicer_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME),
        server,
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(settings.address)
    if port == 0 and not settings.address.startswith("unix:"):
        raise OSError(f"cannot listen on {settings.address}")
    return server, health_servicer, port


async def serve(settings: Settings, ready_file: Path | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT, then shut down in order."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(settings.model_path, settings.state_dir)
    engine = Engine(engine_config(settings))
    log.info("loading %s", settings.model_path)
    info = engine.start()
    try:
        manager = SessionManager(engine, settings)
        await manager.start()
        service = KvStashService(manager, str(settings.model_path), fp)
        server, health_servicer, port = build_server(settings, service)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        where = settings.address if port == 0 else f"{settings.address.rsplit(':', 1)[0]}:{port}"
        log.info(
            "serving %s (%s) on %s: %d slots x %d tokens, %s mode",
            info.description, fp[:12], where, settings.slots, info.n_ctx_seq,
            "exact" if settings.exact else "compact",
        )
        if ready_file is not None:
            ready_file.write_text(f"{port}\n")
        await stop.wait()
        log.info("shutting down")
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        service.accepting = False
        await server.stop(settings.grace_seconds)
    finally:
        engine.stop()
    log.info("stopped")
