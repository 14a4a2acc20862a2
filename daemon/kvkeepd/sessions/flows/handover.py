"""Sessions moving between daemons that share a catalog, and the leases that say who holds one.

A persistent session this daemon does not hold is looked up in the shared catalog when a
request names it, and taken over: its lease first, then its head (`take_over`). The leases
held are renewed in the background (`start`, `stop`); a session whose lease was lost, or
that another daemon asks for, is let go once it is idle: dropped, or handed over after its
head is saved. With the sqlite catalog nothing here happens: every session is this daemon's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvkeepd.errors import KvkeepError, NotFound
from kvkeepd.sessions import ops as opsmod
from kvkeepd.sessions.durability.leases import Leases
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.placement import Stored
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.state.manifest import Snapshot

log = logging.getLogger(__name__)


class Handover:
    """Take-overs and hand-overs of the sessions a SessionHost holds."""

    def __init__(
        self,
        host: SessionHost,
        *,
        leases: Leases,
        persistence: Persistence,
        residency: Residency,
        restored: Callable[[Snapshot, str], Session],
    ) -> None:
        """`restored`: a persistent session as its head's snapshot describes it."""
        self.host = host
        self.leases = leases
        self.persistence = persistence
        self.durable = persistence.durable
        self.residency = residency
        self.restored = restored
        # Per session being looked up: its lock and how many requests use it.
        self._adopting: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._letting_go: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Renew the leases held, and let go of sessions whose leases were lost or asked
        for, in the background, until `stop`."""
        self._tasks = [asyncio.create_task(self.leases.run()), asyncio.create_task(self._watch())]

    async def stop(self) -> None:
        """Stop renewing, and let every lease held go."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for session_id in list(self.leases.held):
            await self.leases.release(session_id)

    async def take_over(self, session_id: str, tenant: Tenant) -> Session:
        """The tenant's persistent session, found in the shared catalog and registered here
        (its lease first, then its head); SessionElsewhere while another daemon holds it."""
        # One lookup per session at a time (others wait for it, then find it registered).
        lock, users = self._adopting.setdefault(session_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with opsmod.current().waiting():
                await lock.acquire()
        except BaseException:
            self._unuse(session_id, users)
            raise
        try:
            if session_id in self.host.sessions:
                return self.host.get(session_id, tenant)
            # Checked before the lease is asked for: an id that is not the tenant's
            # persistent session takes nobody's lease and leaves nothing in the catalog.
            row = await asyncio.to_thread(self.durable.catalog.session, session_id)
            if row is None or row.head is None or row.tenant != tenant.name:
                raise NotFound(f"no session {session_id}")
            token = await self.leases.take(session_id)
            try:
                # The head as of the lease: whoever held it before can no longer move it.
                row = await asyncio.to_thread(self.durable.catalog.session, session_id)
                if row is None or row.head is None:
                    raise NotFound(f"no session {session_id}")
                # And the turns its last holder made durable since that head.
                record = await asyncio.to_thread(self.persistence.journal.record, session_id)
                session, where = await asyncio.to_thread(
                    self.persistence.session_at, session_id, row.head, self.restored, record
                )
            except BaseException:
                await self.leases.release(session_id)
                raise
            session.lease = token
            self.residency.add(session, where)
            self.host.register(session)
            log.info("session %s taken over from the shared catalog", session_id)
            return session
        finally:
            lock.release()
            self._unuse(session_id, users)

    def _unuse(self, session_id: str, users: list[int]) -> None:
        users[0] -= 1
        if not users[0]:
            del self._adopting[session_id]

    async def _watch(self) -> None:
        """Leases lost or asked for: let those sessions go, once each is idle."""
        while True:
            await self.leases.changed.wait()
            self.leases.changed.clear()
            if self._letting_go is None or self._letting_go.done():
                self._letting_go = asyncio.get_running_loop().create_task(self.host.ops.run(self._let_go()))

    async def _let_go(self) -> None:
        stored, self.leases.stored = self.leases.stored, set()
        for session_id in sorted(self.leases.lost | self.leases.wanted | stored):
            session = self.host.sessions.get(session_id)
            if session is None or session.closed:
                self.leases.lost.discard(session_id)
                continue
            if session_id not in self.leases.lost and session.busy:
                continue  # in use here: an asker gets UNAVAILABLE and retries
            async with session.lock:
                lost = session_id in self.leases.lost
                wanted = session_id in self.leases.wanted
                if session.closed:
                    continue
                if not lost and not wanted and not self._still_stored(session):
                    continue  # swapped out, then brought back by a request: it stays
                if not lost and session.dirty:
                    try:
                        await self.residency.save_head(session)
                    except KvkeepError as e:
                        log.warning("session %s is kept: its head was not saved: %s", session_id, e)
                        continue
                lost = session_id in self.leases.lost
                if lost and await self._lease_again(session):
                    continue
                session.closed = session.moved = True
                self.host.unregister(session)
                await self.residency.forget(session)
                if lost:
                    self.leases.lost.discard(session_id)
                    log.warning("session %s dropped: another daemon holds it now", session_id)
                else:
                    await self.leases.release(session_id)
                    if wanted:
                        log.info("session %s handed over to another daemon", session_id)
                    else:
                        log.info("session %s swapped out to storage; its lease is released", session_id)
            self.residency.slot_freed()
        self.host.publish()
        if self.leases.stored:  # swapped out while this pass ran
            self.leases.changed.set()

    def _still_stored(self, session: Session) -> bool:
        """Whether a session swapped out to storage still is (not brought back meanwhile)."""
        return isinstance(self.residency.where(session), Stored) and not session.dirty

    async def _lease_again(self, session: Session) -> bool:
        """A lapsed lease that no other daemon made use of (an outage of the catalog, a pause
        nobody noticed): taken again, the session stays here. True if it does: nobody took
        the lease between (the new token follows this daemon's: each grant raises it by one)
        and the head is still this daemon's last one."""
        catalog = self.durable.catalog
        session_id = session.session_id
        try:
            row = await asyncio.to_thread(catalog.session, session_id)
            if row is None or row.head != session.head_checkpoint_id:
                return False  # another daemon moved it on
            token = await self.leases.take(session_id, wait=False)
            if not token:
                return False
            if token != session.lease + 1:  # another daemon held it meanwhile (its turns: records)
                await self.leases.release(session_id)
                return False
            row = await asyncio.to_thread(catalog.session, session_id)
            if row is None or row.head != session.head_checkpoint_id:
                await self.leases.release(session_id)
                return False
        except KvkeepError as e:
            log.warning("session %s: its lease was not taken again: %s", session_id, e)
            return False
        session.lease = token
        self.leases.lost.discard(session_id)
        log.info("session %s: its lapsed lease was taken again (nobody else had used it)", session_id)
        return True
