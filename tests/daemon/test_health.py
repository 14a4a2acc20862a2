"""The daemon as a process: health, reflection, and a graceful SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import grpc
import pytest
from daemons import NOT_SERVING, SERVICE_NAME, SERVING, DaemonProcess, health_status
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

import kvkeep


def test_subprocess_serves_health_and_reflection_and_stops_on_sigterm(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    proc = spawn_daemon()  # returns once health reports SERVING
    assert proc.ready_file.read_text().strip() == str(proc.port)
    assert health_status(proc.address) == SERVING
    assert health_status(proc.address, SERVICE_NAME) == SERVING

    with grpc.insecure_channel(proc.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert "kvkeep.v1.KvKeep" in services
    assert "grpc.health.v1.Health" in services

    with kvkeep.Client(proc.address, timeout=10) as client:
        assert client.info().mode == "exact"
        session = client.create_session()
        assert session.complete("Hi", max_tokens=2).usage.generated_tokens >= 1

    started = time.monotonic()
    assert proc.terminate(timeout=15) == 0
    assert time.monotonic() - started < 10
    log = proc.log()
    assert "serving" in log
    assert "shutting down" in log
    assert "stopped" in log
    assert "Traceback" not in log
    assert health_status(proc.address, timeout=1) is None


def test_health_watch_sees_not_serving_and_the_daemon_still_exits(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    """Regression: with the synchronous grpc_health servicer on the grpc.aio server, a Watch
    call parked a default-executor thread forever and the daemon hung after "stopped"."""
    proc = spawn_daemon()
    with grpc.insecure_channel(proc.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
        statuses = iter(watch)
        assert next(statuses).status == SERVING
        os.kill(proc.pid, signal.SIGTERM)
        assert next(statuses).status == NOT_SERVING
        watch.cancel()
    try:
        assert proc.terminate(timeout=6) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the daemon did not exit within 6 s of SIGTERM:\n" + proc.log())
