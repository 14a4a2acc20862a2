"""What keeps a web page from driving the HTTP door.

A page of any site can make a visitor's browser send requests to 127.0.0.1: without a
preflight as long as the body's content type is text/plain, form-urlencoded or multipart
(cross-site request forgery), and, once its own host name resolves to 127.0.0.1 (DNS
rebinding), as its own origin, reading the answers. So the door

- takes bodies of JSON alone (`application/json`, `application/*+json`): a page can send
  JSON elsewhere only after a preflight, which the door answers for the origins it lists
  alone (415 otherwise);
- answers a `Host` that names this machine's loopback (localhost, 127.x.x.x, [::1]) or one of
  `--allowed-host`, when it has no auth file (403 otherwise): a rebound name is neither.
  With an auth file the bearer token already stops both attacks (a page cannot add it to a
  cross-origin request, and a rebound page does not have it), and clients elsewhere name
  the daemon as they please, so the Host is checked only where `--allowed-host` is given;
- refuses a request whose `Origin` is another site's (403), unless `--allowed-origin` lists
  it: a page the door serves itself sends its own Host as its origin, and passes. A listed
  origin gets CORS: its preflights are answered and its responses name it in
  `Access-Control-Allow-Origin`.

The probes (/health, /ready) answer anyone, as load balancers and container probes need.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from kvkeepd.api.http.openai import error
from kvkeepd.config.network import NetworkSettings, entries

# ASGI's types (as Starlette names them; the door's stack stays in app.py and door.py).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: `--allowed-host` and `--allowed-origin` entry that lets anything through.
ANY = "*"
PROBES = ("/health", "/ready")
# What a listed origin's preflight is told it may send, and for how long it may remember.
CORS_METHODS = b"GET, POST, DELETE"
CORS_HEADERS = b"authorization, content-type"
CORS_MAX_AGE = b"600"


def host_name(host: str) -> str:
    """The name of a Host header's value (or of an `--allowed-host` entry), without its port,
    lower-cased: `[::1]:8080` is `::1`, `LocalHost.:80` is `localhost`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    return (name if colon and port.isdigit() else host).rstrip(".")


def is_loopback(name: str) -> bool:
    """Whether a host name (as `host_name` gives it) is this machine's loopback."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON: application/json or application/*+json, any parameters."""
    kind = content_type.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


@dataclass(frozen=True)
class BrowserPolicy:
    """Which Host and Origin headers the door answers."""

    #: Host names answered besides loopback ones; None: any Host.
    hosts: frozenset[str] | None
    #: Origins (`scheme://host[:port]`, lower-cased) whose pages may call the door.
    origins: frozenset[str]

    @classmethod
    def of(cls, settings: NetworkSettings) -> BrowserPolicy:
        """The policy of `--allowed-host` and `--allowed-origin`; with `--auth-file` the Host is
        checked only where `--allowed-host` is given."""
        hosts = frozenset(host_name(h) for h in entries(settings.allowed_host))
        checked = not (ANY in hosts or (settings.auth_file is not None and not hosts))
        origins = frozenset(o.lower() for o in entries(settings.allowed_origin))
        return cls(hosts if checked else None, origins)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a request's Host is answered (a request without one is no browser's)."""
        if self.hosts is None or host is None:
            return True
        name = host_name(host)
        return is_loopback(name) or name in self.hosts

    def listed(self, origin: str) -> bool:
        """Whether `--allowed-origin` lets a page of `origin` call the door."""
        return ANY in self.origins or origin.lower() in self.origins


class BrowserGuard:
    """ASGI middleware: the door's application behind a BrowserPolicy."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for k, v in scope["headers"]:  # the first of a repeated header, as Starlette reads it
            headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        host, origin = headers.get("host"), headers.get("origin")
        if not self.policy.host_allowed(host):
            name = host_name(host or "")[:80]
            message = f"the HTTP door does not answer for host {name!r} (see --allowed-host)"
            await _refuse(send, 403, "permission_error", message, "host_not_allowed")
            return
        # A page the door serves itself sends its own Host as its origin.
        same = host is not None and origin is not None and origin.partition("://")[2].lower() == host.lower()
        cross = origin is not None and not same
        if cross and not self.policy.listed(origin or ""):
            message = (
                f"requests from the web origin {(origin or '')[:80]!r} are refused (see --allowed-origin)"
            )
            await _refuse(send, 403, "permission_error", message, "origin_not_allowed")
            return
        if cross and scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(send, origin or "", headers.get("access-control-request-headers"))
            return
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if has_body and not is_json(headers.get("content-type", "")):
            given = headers.get("content-type", "none")
            message = f"the request body must be JSON (Content-Type: application/json), not {given[:80]!r}"
            await _refuse(send, 415, "invalid_request_error", message, "unsupported_media_type")
            return
        if not cross:
            await self.app(scope, receive, send)
            return

        async def send_allowing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *_allow(origin or "")]
            await send(message)

        await self.app(scope, receive, send_allowing)


def _allow(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _preflight(send: Send, origin: str, requested: str | None) -> None:
    """A listed origin's preflight: what it may send (the headers it asks for: its pages are
    trusted as the operator listed them)."""
    headers = [
        *_allow(origin),
        (b"access-control-allow-methods", CORS_METHODS),
        (b"access-control-allow-headers", requested.encode("latin-1") if requested else CORS_HEADERS),
        (b"access-control-max-age", CORS_MAX_AGE),
        (b"content-length", b"0"),
    ]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(send: Send, status: int, kind: str, message: str, code: str) -> None:
    body = json.dumps(error(kind, message, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
