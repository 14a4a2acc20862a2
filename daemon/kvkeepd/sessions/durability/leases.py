"""Leases: one writer per persistent session when daemons share a catalog.

A daemon takes a session's lease in the catalog before it reads the session's head or
writes a new one, renews the leases it holds in the background, and lets one go when it
closes the session, hands it over or shuts down. Each grant carries a fencing token, larger
than any before it for that session; every head write and turn record is conditioned on it
(in the catalog's script), so a daemon that lost its lease (paused past its expiry, cut off
from the server) never writes that session again: its write is refused and it drops it.

A daemon asked for a session another one holds marks it wanted; the holder, at its next
renewal, lets an idle session go (saving its head first), so the asker gets it
within a renewal period. A busy one is kept, and the asker answers UNAVAILABLE with a retry
hint after `lease_wait`. A persistent session swapped out to storage is let go too (its
head is saved then), so that the next daemon asked for it takes it at once. With the sqlite
catalog every lease is granted at once (the state directory's lock already makes this
daemon the only writer).

Work that the cluster needs done once, not by every daemon (expiring the sessions no daemon
holds, collecting orphaned blocks), is a *duty*: a lease of its own (`duty`), which a daemon
takes at each pass and keeps while it keeps passing; another daemon takes it only once the
holder stops (dies, or stops asking) and its lease lapses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

from kvkeepd.errors import KvkeepError, SessionElsewhere
from kvkeepd.storage.catalog import Catalog, Lease

log = logging.getLogger(__name__)

#: How often a request waiting for a leased session asks for it again.
POLL_SECONDS = 0.1
#: What a duty's lease is keyed by, before its name (session ids begin "s_": never this).
DUTY_PREFIX = "@"


class Leases:
    """The leases this daemon holds in one catalog."""

    def __init__(self, catalog: Catalog, lease_seconds: float, wait_seconds: float, name: str = "") -> None:
        """`name`: how listings name this daemon (default: host name/process id)."""
        self.catalog = catalog
        self.shared = catalog.shared
        self.ttl_ms = max(1, int(lease_seconds * 1000))
        self.wait_seconds = wait_seconds
        self.name = name or f"{socket.gethostname()}/{os.getpid()}"
        # Unique per process: a restarted daemon is another holder (its old leases lapse).
        self.holder = f"{self.name}#{secrets.token_hex(4)}"
        self.held: dict[str, int] = {}
        # Sessions whose lease this daemon no longer has, or that another daemon asks for;
        # the session manager drops or hands them over (`changed` tells it to look).
        self.lost: set[str] = set()
        self.wanted: set[str] = set()
        # Sessions swapped out to storage: let go once idle (their heads are saved).
        self.stored: set[str] = set()
        # The duties this daemon holds now (logged when one is gained or lost).
        self.duties: set[str] = set()
        # Set when `lost` or `wanted` gained sessions: the Handover looks then.
        self.changed = asyncio.Event()
        # Whether the catalog answered the last renewal (or ping): the metrics show it.
        self.reachable = True

    async def take(self, session_id: str, wait: bool = True) -> int:
        """The session's lease (its fencing token), waiting up to `lease_wait` for another
        holder to let it go or for its lease to lapse; SessionElsewhere after that (without
        `wait`: 0 at once)."""
        if not self.shared:
            return 1
        deadline = time.monotonic() + (self.wait_seconds if wait else 0)
        while True:
            lease = await asyncio.to_thread(self.catalog.take_lease, session_id, self.holder, self.ttl_ms)
            if lease.token:
                self.held[session_id] = lease.token
                return lease.token
            if not wait:
                return 0
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionElsewhere(
                    f"session {session_id} is in use on another daemon; retry in {lease.wait_ms} ms",
                    retry_after_ms=max(1, lease.wait_ms),
                )
            # Asked often: a holder hands an idle session over at any of its renewals.
            await asyncio.sleep(min(left, max(0.02, lease.wait_ms / 1000), POLL_SECONDS))

    def let_go(self, session_id: str) -> None:
        """The session was swapped out to storage: with a shared catalog, let it go (and its
        lease) once it is idle."""
        if self.shared:
            self.stored.add(session_id)
            self.changed.set()

    async def duty(self, name: str, period: float) -> bool:
        """Whether this daemon has the cluster's duty `name` now: its lease, taken (or
        extended) here, lasting three `period`s (the caller asks at least once a period).
        With the sqlite catalog this daemon is the cluster: always."""
        if not self.shared:
            return True
        ttl_ms = max(self.ttl_ms, int(3 * period * 1000))
        try:
            lease = await asyncio.to_thread(self.catalog.take_lease, DUTY_PREFIX + name, self.holder, ttl_ms)
        except KvkeepError as e:
            log.warning("the %s duty was not asked for: %s", name, e)
            lease = Lease(0)
        if lease.token and name not in self.duties:
            log.info("this daemon now does the cluster's %s", name)
            self.duties.add(name)
        elif not lease.token and name in self.duties:
            log.info("another daemon does the cluster's %s now", name)
            self.duties.discard(name)
        return lease.token > 0

    async def release(self, session_id: str) -> None:
        """Let the lease go (best effort: unreleased, it lapses by itself)."""
        token = self.held.pop(session_id, None)
        self.wanted.discard(session_id)
        if not self.shared or token is None:
            return
        try:
            await asyncio.to_thread(self.catalog.release_lease, session_id, self.holder, token)
        except KvkeepError as e:
            log.warning("the lease of session %s was not released (it lapses by itself): %s", session_id, e)

    def forget(self, session_id: str) -> None:
        """The session is gone from the catalog (closed): its lease went with it."""
        self.held.pop(session_id, None)
        self.lost.discard(session_id)
        self.wanted.discard(session_id)
        self.stored.discard(session_id)

    def fenced(self, session_id: str) -> None:
        """A write was refused: another daemon took the session."""
        self.held.pop(session_id, None)
        self.lost.add(session_id)
        self.changed.set()

    async def run(self) -> None:
        """Renew the held leases three times per lease period until cancelled (holding none,
        ask the catalog whether it answers). A lease not renewed (the catalog unreachable)
        may lapse: the next renewal finds it lost."""
        if not self.shared:
            return
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            held = dict(self.held)
            try:
                if held:
                    lost, wanted = await asyncio.to_thread(
                        self.catalog.renew_leases, self.holder, held, self.ttl_ms
                    )
                else:
                    await asyncio.to_thread(self.catalog.ping)
                    lost, wanted = set(), set()
            except KvkeepError as e:
                if self.reachable:
                    log.warning("the catalog does not answer; leases not renewed: %s", e)
                self.reachable = False
                continue
            if not self.reachable:
                log.info("the catalog answers again")
            self.reachable = True
            # A session released or re-taken meanwhile is not lost.
            lost = {sid for sid in lost if self.held.get(sid) == held[sid]}
            for sid in lost:
                log.warning("the lease of session %s lapsed: another daemon may hold it", sid)
                self.held.pop(sid, None)
            self.lost |= lost
            self.wanted = {sid for sid in wanted if sid in self.held}
            if self.lost or self.wanted:  # new ones, or ones a busy moment left
                self.changed.set()
