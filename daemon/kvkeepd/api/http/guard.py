"""What keeps idle and slow connections from closing the HTTP door.

uvicorn times a connection out only once it has answered a request on it (keep-alive), so a
connection that never sends a whole request would be held forever, and its bound on
concurrency counts connections, so enough idle ones would answer every request 503. The
door's protocol (uvicorn's h11 one, guarded) instead

- closes a connection that has not sent a whole request (head and body) within
  `read_timeout` seconds of opening or of its previous response, however slowly it trickles;
- closes a new connection at once beyond `per_peer` from one peer (an IPv4 address, or an
  IPv6 /64: one host's usual share);
- holds at most `total` connections, so that the daemon keeps descriptors for its own files
  and for gRPC: a new connection beyond it closes the one that has owed a request longest
  (as nginx reuses idle connections), so idle connections never keep a new one out; only
  when every connection is in a request is the new one closed.

The bound on requests served at once is the application's (OpenAiDoor), and counts only
requests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def descriptor_share() -> int:
    """Connections the door may hold in all: half of the process's descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft // 2) if soft != resource.RLIM_INFINITY else 1 << 16


def peer_key(peername: object) -> str:
    """Whom a connection counts against: its IPv4 address, or its IPv6 address's /64."""
    if not isinstance(peername, tuple) or not peername:
        return ""
    host = str(peername[0])
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Peers:
    """The connections the door holds, per peer and in all (event loop only)."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer = per_peer  # 0: no bound per peer
        self.total = total
        self.held = 0
        self._by_peer: dict[str, int] = {}
        # The connections that owe a request, longest first (dicts keep insertion order).
        self._owing: dict[asyncio.BaseTransport, None] = {}

    def admit(self, peer: str) -> bool:
        """Count a new connection of `peer` in, unless it would exceed a bound."""
        n = self._by_peer.get(peer, 0)
        if self.per_peer and n >= self.per_peer:
            return False
        if self.held >= self.total:
            if not self._owing:
                return False
            oldest = next(iter(self._owing))
            self.paid(oldest)
            log.debug("an idle HTTP connection is closed to make room for a new one")
            oldest.close()  # counted out when it is lost, on the next turn of the loop
        self._by_peer[peer] = n + 1
        self.held += 1
        return True

    def owes(self, transport: asyncio.BaseTransport) -> None:
        """The connection owes a request from now on."""
        self._owing[transport] = None

    def paid(self, transport: asyncio.BaseTransport) -> None:
        """The connection has sent its whole request, or is gone."""
        self._owing.pop(transport, None)

    def leave(self, peer: str) -> None:
        n = self._by_peer.pop(peer, 0) - 1
        if n > 0:
            self._by_peer[peer] = n
        self.held -= 1


def guarded_protocol(peers: Peers, read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection bounds of `peers` and a deadline of
    `read_timeout` seconds for each request to arrive whole."""

    class GuardedH11Protocol(H11Protocol):
        _peer: str | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            peer = peer_key(transport.get_extra_info("peername"))
            if not peers.admit(peer):
                log.debug("an HTTP connection of %s is closed: too many connections", peer or "a peer")
                transport.close()
                return
            self._peer = peer
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._peer is not None:
                peers.leave(self._peer)
                self._peer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def _watch(self) -> None:
            """Armed while the client owes a request (its head or body), from the moment it
            began to owe it: bytes that trickle in do not push the deadline back."""
            owes = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            if owes and self._deadline is None and not self.transport.is_closing():
                self._deadline = self.loop.call_later(read_timeout, self._overdue)
                peers.owes(self.transport)
            elif not owes:
                self._disarm()

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
                peers.paid(self.transport)

        def _overdue(self) -> None:
            self._deadline = None
            peers.paid(self.transport)
            if not self.transport.is_closing():
                log.debug("an HTTP connection is closed: no whole request within %.1f s", read_timeout)
                self.transport.close()

    return GuardedH11Protocol
