"""Where the doors listen: each TCP address is tried before the model loads, so that a busy
port is one line naming the setting to change, not a failure after a minute of loading.

`bind` gives the HTTP door its socket, bound now and served later; gRPC binds its own port once
the service exists, so `check_free` only tries its address now (and Prometheus's).
"""

from __future__ import annotations

import errno
import socket


def bind(address: str, door: str, change: str) -> socket.socket:
    """A socket bound to `host:port` (port 0: any free one), not yet listening; OSError naming
    the door and the settings that choose its address (`change`) if it cannot be bound."""
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (OSError, ValueError) as e:
        raise OSError(f"cannot listen on {address} ({door}): {_reason(e)}; {change}") from None
    sock = socket.socket(family, kind, proto)
    try:
        # As gRPC and uvicorn do: a port whose last connections are in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {address} ({door}): {_reason(e)}; {change}") from None
    return sock


def check_free(address: str, door: str, change: str) -> None:
    """Raise what `bind` raises if `address` (host:port; a unix socket passes) cannot be bound."""
    if not address.startswith("unix:"):
        bind(address, door, change).close()


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return "the port is in use (by another kvkeep daemon, or another program)"
    if isinstance(e, OSError) and e.errno == errno.EADDRNOTAVAIL:
        return "no interface of this machine has that address"
    if isinstance(e, socket.gaierror):
        return f"unknown host ({e.strerror})"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror.lower()
    return str(e)
