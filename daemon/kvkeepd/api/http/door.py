"""uvicorn serving the door's application as a task of the daemon's own event loop, so its
handlers reach the SessionManager directly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator, Sequence

import uvicorn

from kvkeepd.api.http.app import OpenAiDoor
from kvkeepd.api.http.body_limits import limited
from kvkeepd.api.http.browsers import BrowserPolicy
from kvkeepd.api.http.guard import Peers, descriptor_share, guarded_protocol
from kvkeepd.config.settings import Settings
from kvkeepd.sessions.manager import SessionManager

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The daemon owns SIGTERM and SIGINT (an ordered shutdown stops this server first).
        yield


class HttpDoor:
    """The HTTP door of a daemon: started after the manager, stopped before it shuts down."""

    def __init__(self, settings: Settings, manager: SessionManager, names: Sequence[str] = ()) -> None:
        self.settings = settings
        self.door = OpenAiDoor(
            manager,
            settings.model_path.stem,
            settings.max_message_bytes,
            names,
            browsers=BrowserPolicy.of(settings),
            heartbeat=settings.http_heartbeat,
            console=settings.console,
        )
        self.port = 0
        self.peers = Peers(settings.http_connections_per_peer, descriptor_share())
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, sock: socket.socket) -> int:
        """Listen on `sock` (bound) and serve; returns the bound port."""
        s = self.settings
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            limited(self.door),
            interface="asgi3",
            proxy_headers=False,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=max(1, round(s.grace_seconds)),
            # Connections are bounded by the guarded protocol (guard.py), requests served at
            # once by the application: uvicorn's limit_concurrency counts idle connections too.
            http=guarded_protocol(self.peers, s.http_read_timeout),
            ssl_certfile=str(s.tls_cert) if s.tls_cert else None,
            ssl_keyfile=str(s.tls_key) if s.tls_key else None,
            ssl_ca_certs=str(s.tls_client_ca) if s.tls_client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if s.tls_client_ca else ssl.CERT_NONE,
        )
        server = self._server = _Server(config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                sock.close()
                self._task.result()
                raise OSError(f"the HTTP door did not start on {self.address}")
            await asyncio.sleep(0.01)
        log.debug("uvicorn serves the HTTP door on %s", self.address)
        return self.port

    @property
    def address(self) -> str:
        return f"{(self.settings.http_listen or '').rpartition(':')[0]}:{self.port}"

    def refuse(self) -> None:
        """New requests get 503 from now on."""
        self.door.accepting = False

    async def stop(self) -> None:
        """Refuse new requests, let those in flight end within the grace period, close."""
        self.refuse()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.door.keep.close_all()
