"""Server bootstrap: engine, session manager, gRPC server with health and reflection,
signals and an ordered, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # stubs lack it

from kvkeepd.api.grpc_door import GRPC_CHANGE, SERVICE_NAME, build_server, server_credentials
from kvkeepd.api.listen import bind, check_free
from kvkeepd.api.metrics import serve_metrics
from kvkeepd.api.service import KvKeepService
from kvkeepd.config.settings import ConfigError, Settings
from kvkeepd.engine.context import ModelInfo
from kvkeepd.engine.context_config import ContextConfig
from kvkeepd.engine.engine import Engine
from kvkeepd.heap import keep_freed_memory
from kvkeepd.model.fingerprints import fingerprint
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.prompting.templates import ChatTemplate
from kvkeepd.sessions.tenants import AuthFileError, Quota, Tenants
from kvkeepd.storage.journal import TurnJournal
from kvkeepd.storage.statedir import StateDir
from kvkeepd.storage.stores import open_stores

if TYPE_CHECKING:
    from kvkeepd.api.http.door import HttpDoor

log = logging.getLogger(__name__)


def load_tenants(settings: Settings) -> Tenants:
    """The tenants of the auth file, or the one anonymous tenant; AuthFileError if the file
    cannot be used."""
    sessions, parked, stored = settings.quota()
    default = Quota(max_sessions=sessions, max_parked_bytes=parked, max_stored_bytes=stored)
    if settings.auth_file is None:
        return Tenants.anonymous(default)
    return Tenants.load(settings.auth_file, default)


#: What to change when a door's address cannot be listened on.
HTTP_CHANGE = "choose another with --http-port (or --http), or turn the HTTP door off with --http off"
METRICS_CHANGE = "choose another address with --metrics-address"


def check_addresses(settings: Settings) -> socket.socket | None:
    """Try every address the daemon will listen on, before anything heavy starts: OSError
    names a busy one. Returns the HTTP door's socket, bound (None without the door)."""
    check_free(settings.grpc_listen, "gRPC", GRPC_CHANGE)
    if settings.metrics_address:
        check_free(settings.metrics_address, "metrics", METRICS_CHANGE)
    http = settings.http_listen
    return bind(http, "HTTP", HTTP_CHANGE) if http is not None else None


def on_port(address: str, port: int) -> str:
    """`address` (host:port) with the port a listener was given (for port 0)."""
    return f"{address.rpartition(':')[0]}:{port}"


def template_source(settings: Settings) -> str | None:
    """The chat template --chat-template-file gives (None: the model's own)."""
    if settings.chat_template_file is None:
        return None
    try:
        return settings.chat_template_file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("chat-template-file", f"cannot read {settings.chat_template_file}: {e}") from None


def _mode(info: ModelInfo) -> str:
    """The engine's mode for the serving line: exact or compact, and exact mode's attention."""
    if not info.exact:
        return "compact"
    if info.flash_attention:
        return "exact (batch-invariant flash attention)"
    return "exact (attention without flash" + (": see the warning above)" if info.flash_note else ")")


def http_door(settings: Settings, manager: SessionManager, names: Sequence[str]) -> HttpDoor:
    """The OpenAI-compatible HTTP door (imported only when asked for: an optional extra)."""
    try:
        from kvkeepd.api.http.door import HttpDoor
    except ImportError as e:
        raise OSError(
            f"the HTTP door needs {e.name}: pip install 'kvkeep[daemon]' (or --http off for no door)"
        ) from None
    return HttpDoor(settings, manager, names)


class Daemon:
    """The whole daemon, startable and stoppable from any event loop (tests use this)."""

    def __init__(
        self, settings: Settings, clock: Callable[[], float] = time.time, names: Sequence[str] = ()
    ) -> None:
        self.settings = settings
        self.clock = clock
        # Other names the model goes by (hf:OWNER/REPO:QUANT's), beside its file's.
        self.names = tuple(names)
        self.engine = Engine(ContextConfig.of(settings))
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._service: KvKeepService | None = None
        self.manager: SessionManager | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._metrics: Any = None
        self.metrics_port = 0
        self._state: StateDir | None = None
        self._http: HttpDoor | None = None
        self.http_port = 0
        self._journal: TurnJournal | None = None

    async def start(self) -> int:
        """Load the model, start serving, report SERVING. Returns the bound port."""
        settings = self.settings
        keep_freed_memory()
        # File work (hashing the model, opening the catalog and block stores) and loading
        # the model run in worker threads: the event loop never waits on them. The state
        # directory is locked before anything in it is touched.
        state = self._state = await asyncio.to_thread(StateDir.take, settings.state_dir)
        http_socket: socket.socket | None = None
        try:
            http_socket = await asyncio.to_thread(check_addresses, settings)
            fp = await asyncio.to_thread(fingerprint, settings.model_path, state.path)
            size = settings.model_path.stat().st_size
            log.info("loading the model %s (%.0f MiB)", settings.model_path, size / (1 << 20))
            info = await asyncio.to_thread(self.engine.start)
            stores = await asyncio.to_thread(open_stores, settings, state, info, fp, self.clock)
            self._journal = stores.journal
            source = await asyncio.to_thread(template_source, settings)
            template = await ChatTemplate.of_model(self.engine, settings.tool_format, source)
            tenants = await asyncio.to_thread(load_tenants, settings)
            # Every durable save holds room under its tenant's quota before it writes.
            stores.durable.quota = tenants.stored_quota
            manager = SessionManager(self.engine, settings, stores, template, tenants, clock=self.clock)
            await manager.start()
            self.manager = manager
            self._sweeper = asyncio.create_task(manager.run_expiry())
            if settings.metrics_address:
                self._metrics = serve_metrics(settings.metrics_address, manager)
                self.metrics_port = int(self._metrics.server_port)

            credentials = await asyncio.to_thread(server_credentials, settings)
            http = settings.http_listen
            self._service = KvKeepService(
                manager,
                str(settings.model_path),
                fp,
                http_address=on_port(http, http_socket.getsockname()[1]) if http and http_socket else "",
                metrics_address=on_port(settings.metrics_address, self.metrics_port) if self._metrics else "",
            )
            # A unix socket is created owner-only: the umask is in force while gRPC binds it.
            old_umask = os.umask(0o177)
            try:
                self._server, self._health, self.port = build_server(settings, self._service, credentials)
                await self._server.start()
            finally:
                os.umask(old_umask)
            if http_socket is not None:
                self._http = http_door(settings, manager, self.names)
                self.http_port = await self._http.start(http_socket)
                http_socket = None  # the door's now
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError | KeyboardInterrupt):
                log.info("interrupted while starting: stopping once the engine ends what it began")
            if http_socket is not None:
                http_socket.close()
            if self._server is not None:
                await self._server.stop(0)
            if self._journal is not None:
                self._journal.close()  # on the loop: what it queued goes first
            await asyncio.to_thread(self.engine.stop)
            self._release_state()
            raise
        if settings.exact and not info.exact:
            log.warning(
                "this llama.cpp build evaluates a token alone differently from inside a prompt "
                "chunk (built with GGML_LLAMAFILE, or a backend whose kernels depend on the batch "
                "shape): generation is deterministic, but restores by re-evaluation are not "
                "bit-exact; scripts/setup builds it for the CPU without"
            )
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        # By the file's own name: llama.cpp's description ("llama 256M Q4_1") is a size class
        # of the architecture, not the model a user chose.
        log.info(
            "serving %s (%.0f MiB, %s, fingerprint %s): %d slots x %d tokens, %s mode, %s memory; %s",
            settings.model_path.name,
            size / (1 << 20),
            info.architecture,
            fp[:12],
            settings.slots,
            info.n_ctx_seq,
            _mode(info),
            info.memory,
            info.layout_note,
        )
        for line in self.listening():
            log.info("%s", line)
        return self.port

    def listening(self) -> list[str]:
        """Where each door listens, one line each (logged once serving)."""
        lines = [f"gRPC (kvkeep CLI and SDK) on {self.address}"]
        if self._http is not None:
            lines.append(f"OpenAI-compatible HTTP on http://{self._http.address}/v1 (health: /health)")
        if self._metrics is not None:
            address = on_port(self.settings.metrics_address, self.metrics_port)
            lines.append(f"Prometheus metrics on http://{address}/metrics")
        return lines

    async def reload_tenants(self) -> None:
        """Read the auth file again (SIGHUP); a file that cannot be used keeps the old one."""
        if self.manager is None or self.settings.auth_file is None:
            return
        try:
            tenants = await asyncio.to_thread(load_tenants, self.settings)
        except AuthFileError as e:
            log.error("the auth file was not reloaded: %s", e)
            return
        self.manager.replace_tenants(tenants)
        log.info("auth file reloaded: %d tenants", len(tenants.names))

    @property
    def address(self) -> str:
        listen = self.settings.grpc_listen
        if listen.startswith("unix:"):
            return listen
        return f"{listen.rsplit(':', 1)[0]}:{self.port}"

    async def stop(self) -> None:
        """Health NOT_SERVING, refuse new work, drain for the grace period, free the model."""
        log.info("shutting down")
        if self._health is not None:
            # NOT_SERVING for every service, and Watch streams told and ended.
            await self._health.enter_graceful_shutdown()
        if self._service is not None:
            self._service.accepting = False
        if self._http is not None:
            self._http.refuse()
        # Both doors drain at once, within one grace period, before the manager shuts down.
        stopping = []
        if self._server is not None:
            stopping.append(self._server.stop(self.settings.grace_seconds))
        if self._http is not None:
            stopping.append(self._http.stop())
        await asyncio.gather(*stopping)
        if self._metrics is not None:
            self._metrics.shutdown()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.manager is not None:
            await self.manager.shutdown()
        if self._journal is not None:
            self._journal.close()  # on the loop: what it queued goes first
        await asyncio.to_thread(self.engine.stop)
        self._release_state()
        log.info("stopped")

    def _release_state(self) -> None:
        """Wipe the spill area and unlock the state directory (last: until then it is ours)."""
        if self._state is not None:
            state, self._state = self._state, None
            state.wipe_spill()
            state.release()

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        if self._health is not None:
            for name in ("", SERVICE_NAME):
                await self._health.set(name, status)


async def serve(settings: Settings, ready_file: Path | None = None, names: Sequence[str] = ()) -> None:
    """Run the daemon until SIGTERM/SIGINT, then shut down in order. `names`: other names the
    model goes by (its Hub reference), beside its file's."""
    daemon = Daemon(settings, names=names)
    port = await daemon.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    def reload() -> None:
        task = loop.create_task(daemon.reload_tenants())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, reload)
    if ready_file is not None:
        await asyncio.to_thread(ready_file.write_text, f"{port}\n")
    try:
        await stop.wait()
    finally:
        await daemon.stop()
