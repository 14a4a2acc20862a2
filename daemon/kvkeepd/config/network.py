"""The network and security settings: where the doors listen (`--host` with `--port` for gRPC
and `--http-port` for HTTP, or a whole `--address` or `--http` in their place), and who may
call them (tenants, TLS). `Settings` (kvkeepd.config.settings) is made of these and the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvkeepd.config.option import ConfigError, spec
from kvkeepd.urls import is_local

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
# llama-server's port: what OpenAI clients set up for a local llama.cpp server already use.
DEFAULT_HTTP_PORT = 8080

#: `--console`: the web console served, served without its actions, or not served.
CONSOLE_MODES = ("on", "read-only", "off")
#: `--http off`: no HTTP door.
OFF = "off"

# An `--allowed-host` entry: a name or an address ([IPv6] in brackets), a port ignored; and an
# `--allowed-origin` entry: scheme://host[:port], as a browser's Origin header writes it.
_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?"
_ALLOWED_HOST = re.compile(rf"^{_HOST}$")
_ALLOWED_ORIGIN = re.compile(rf"^[A-Za-z][A-Za-z0-9+.-]*://{_HOST}$")


def entries(value: str) -> tuple[str, ...]:
    """The entries of a comma-separated setting, without blanks."""
    return tuple(filter(None, (e.strip() for e in value.split(","))))


def joined(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def tcp_problem(address: str, port_flag: str = "") -> str:
    """What is wrong with a host:port address ("" if nothing); `port_flag` names the setting
    that takes a port alone, for one given instead of an address."""
    host, colon, port = address.rpartition(":")
    if address.isdigit() and port_flag:
        return f"must be host:port, got {address!r} (for a port alone: {port_flag} {address})"
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        return f"must be host:port, got {address!r}"
    return ""


def grpc_problem(address: str) -> str:
    """What is wrong with a gRPC address, host:port or unix:PATH ("" if nothing)."""
    if address.startswith("unix:"):
        return "" if len(address) > len("unix:") else "unix: needs a path"
    return tcp_problem(address, "--port")


@dataclass(frozen=True)
class NetworkSettings:
    """Where the daemon listens and who may call it (the first fields of Settings)."""

    host: str = field(
        default=DEFAULT_HOST,
        metadata=spec(
            "Host name or IP address the gRPC and HTTP doors listen on (0.0.0.0 or :: for every "
            "interface, which needs --auth-file)."
        ),
    )
    port: int = field(
        default=DEFAULT_PORT, metadata=spec("Port of the gRPC door (0 picks a free one).", low=0, high=65535)
    )
    address: str = field(
        default="",
        metadata=spec(
            "Where the gRPC door listens, host:port or unix:PATH, in the place of --host and --port.",
            shown="HOST:PORT",
        ),
    )
    http_port: int = field(
        default=DEFAULT_HTTP_PORT,
        metadata=spec("Port of the OpenAI-compatible HTTP door (0 picks a free one).", low=0, high=65535),
    )
    http_address: str = field(
        default="",
        metadata=spec(
            "Where the OpenAI-compatible HTTP door listens (/v1/chat/completions, /v1/completions, "
            "/v1/models, /v1/responses, /health), host:port in the place of --host and --http-port; "
            "off: no HTTP door.",
            key="http",
            shown="HOST:HTTP-PORT",
        ),
    )
    http_read_timeout: float = field(
        default=30.0,
        metadata=spec(
            "Seconds an HTTP connection has to send a whole request (head and body) once it opens or "
            "its previous response ends; then it is closed.",
            low=0.1,
            high=3600,
        ),
    )
    http_heartbeat: float = field(
        default=10.0,
        metadata=spec(
            "Seconds a streamed HTTP reply may send nothing, its prompt being evaluated say, before it "
            "sends a heartbeat event, so that a client's idle timeout (Codex CLI's) does not close it.",
            low=0.05,
            high=3600,
        ),
    )
    http_connections_per_peer: int = field(
        default=256,
        metadata=spec(
            "HTTP connections one peer (an IPv4 address or an IPv6 /64) may hold open; more are closed "
            "at once (0: no bound, e.g. behind a proxy that bounds its clients).",
            low=0,
            high=1 << 20,
        ),
    )
    allowed_host: str = field(
        default="",
        metadata=spec(
            "Host names (comma-separated) the HTTP door answers besides loopback ones (localhost, "
            "127.x.x.x, [::1]), e.g. a reverse proxy's; another Host gets 403 (a page whose name was "
            "made to point here). Checked without --auth-file, or with it where this is set; * "
            "answers any.",
        ),
    )
    allowed_origin: str = field(
        default="",
        metadata=spec(
            "Web origins (comma-separated scheme://host[:port]) whose pages may call the HTTP door, "
            "with CORS; a page of another origin gets 403, one the door serves itself passes; * "
            "lets any.",
        ),
    )
    console: str = field(
        default="on",
        metadata=spec(
            "The web console on the HTTP door's / (console.md): on, read-only (it shows sessions and "
            "chats, and refuses restore, fork, delete and checkpoint with 403) or off.",
            choices=CONSOLE_MODES,
        ),
    )
    metrics_address: str = field(
        default="",
        metadata=spec("host:port to serve Prometheus metrics on (/metrics); empty: off.", shown="off"),
    )
    auth_file: Path | None = field(
        default=None,
        metadata=spec(
            "TOML file of tenants and their bearer tokens ([tenants.NAME] tokens = [...]); re-read on "
            "SIGHUP. Without it: one anonymous tenant, loopback or unix socket only.",
            file=True,
        ),
    )
    tls_cert: Path | None = field(default=None, metadata=spec("TLS certificate (PEM).", file=True))
    tls_key: Path | None = field(default=None, metadata=spec("TLS private key (PEM).", file=True))
    tls_client_ca: Path | None = field(
        default=None,
        metadata=spec("CA (PEM) whose client certificates are required (mutual TLS).", file=True),
    )
    tenant_quota: str = field(
        default="",
        metadata=spec(
            "Default per-tenant limits, e.g. sessions=100,parked_bytes=1000000000,stored_bytes=5000000000 "
            "(0 or absent: none); the auth file may set them per tenant.",
        ),
    )
    max_message_bytes: int = field(
        default=4 << 20,
        metadata=spec("Largest gRPC message accepted.", low=1 << 10, high=256 << 20, unit="bytes"),
    )

    @property
    def grpc_listen(self) -> str:
        """Where the gRPC door listens: --address, else --host and --port."""
        return self.address or joined(self.host, self.port)

    @property
    def http_listen(self) -> str | None:
        """Where the HTTP door listens: --http, else --host and --http-port; None: no door."""
        if self.http_address == OFF:
            return None
        return self.http_address or joined(self.host, self.http_port)

    def check_network(self) -> None:
        """Check how the network settings go together; ConfigError naming the setting."""
        problem = grpc_problem(self.address) if self.address else ""
        if problem:
            raise ConfigError("address", problem)
        problem = tcp_problem(self.http_address, "--http-port") if self.http_address not in ("", OFF) else ""
        if problem:
            raise ConfigError("http", problem)
        if self.metrics_address and tcp_problem(self.metrics_address):
            raise ConfigError("metrics-address", tcp_problem(self.metrics_address))
        http = self.http_listen
        if http is not None and self.auth_file is None and not is_local(http):
            raise ConfigError(
                "http" if self.http_address else "host",
                f"without auth-file the HTTP API listens on loopback only, not {http}",
            )
        grpc = self.grpc_listen
        if self.auth_file is None and not is_local(grpc):
            raise ConfigError(
                "address" if self.address else "host",
                f"without auth-file the daemon listens on loopback or a unix socket only, not {grpc}",
            )
        for entry in entries(self.allowed_host):
            if entry != "*" and not _ALLOWED_HOST.match(entry):
                raise ConfigError("allowed-host", f"takes host names, comma-separated, got {entry!r}")
        for entry in entries(self.allowed_origin):
            if entry != "*" and not _ALLOWED_ORIGIN.match(entry):
                raise ConfigError(
                    "allowed-origin", f"takes origins such as https://console.example:8443, got {entry!r}"
                )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "tls-cert" if self.tls_cert is None else "tls-key", "tls-cert and tls-key go together"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls-client-ca", "needs tls-cert and tls-key")
        self.quota()  # raises on a malformed value

    def quota(self) -> tuple[int, int, int]:
        """The default tenant quota: (sessions, parked bytes, stored bytes); 0 means none."""
        values = {"sessions": 0, "parked_bytes": 0, "stored_bytes": 0}
        for part in filter(None, (p.strip() for p in self.tenant_quota.split(","))):
            key, _, value = part.partition("=")
            if key.strip() not in values or not value.strip().isdigit():
                raise ConfigError(
                    "tenant-quota", f"takes sessions=N,parked_bytes=N,stored_bytes=N; got {part!r}"
                )
            values[key.strip()] = int(value)
        return values["sessions"], values["parked_bytes"], values["stored_bytes"]
