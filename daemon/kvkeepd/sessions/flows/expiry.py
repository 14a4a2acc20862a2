"""The sweeper: idle sessions expire, and RAM and disk are kept within their budgets.

Every `sweep_interval` seconds, one pass runs as an operation (ops.py): sessions idle past
`--idle-ttl` (ephemeral) or `--persistent-ttl` (persistent) are closed as a client's close
would; stored responses older than `--response-ttl` are deleted, and kept prefixes past
their time to live; with a shared catalog, the persistent sessions that no daemon holds,
and the stored responses and kept prefixes, expire there by
whichever one daemon has the cluster's expiry duty (leases.py: one at a time, another
taking over when it dies), and the blocks that saves cut short left in a shared store are
collected by the holder of the collector duty (storage/collector.py); parked state beyond
the RAM budget spills to disk, and unreferenced blocks beyond the disk budget are dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvkeepd.config.settings import Settings
from kvkeepd.errors import KvkeepError
from kvkeepd.sessions.durability.leases import Leases
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.session import Session
from kvkeepd.storage.collector import collect
from kvkeepd.storage.stores import Stores

log = logging.getLogger(__name__)

#: With a shared catalog, the most persistent sessions one sweep deletes there.
EXPIRED_PER_SWEEP = 100
#: The duty of collecting orphaned blocks of a shared store.
COLLECTOR_DUTY = "collector"
#: The duty (leases.py) of expiring what no daemon holds: persistent sessions and stored
#: responses.
EXPIRY_DUTY = "expiry"


class Sweeper:
    """Expiry and budget sweeps of the sessions a SessionHost holds."""

    def __init__(
        self,
        host: SessionHost,
        settings: Settings,
        residency: Residency,
        stores: Stores,
        leases: Leases,
        close: Callable[[Session], Awaitable[None]],
        expire_responses: Callable[[float], Awaitable[int]],
        expire_prefixes: Callable[[float], Awaitable[int]],
    ) -> None:
        """`close`: closes a session as a client's close would; `expire_responses`: deletes
        the stored responses older than --response-ttl as of a time, `expire_prefixes` the
        kept prefixes past their time to live; `leases`: whose duty leases say which daemon
        expires what no daemon holds."""
        self.host = host
        self.settings = settings
        self.residency = residency
        self.stores = stores
        self.leases = leases
        self.close = close
        self.expire_responses = expire_responses
        self.expire_prefixes = expire_prefixes

    async def sweep(self) -> None:
        """One pass of the sweeper: expire idle sessions, keep RAM and disk within budget."""
        await self.host.ops.run(self._sweep())

    async def _sweep(self) -> None:
        settings, durable = self.settings, self.stores.durable
        now = self.host.clock()
        for session in list(self.host.sessions.values()):
            if session.busy or session.closed:
                continue
            ttl = settings.persistent_ttl if session.persistent else settings.idle_ttl
            if ttl > 0 and now - session.last_used_at > ttl:
                log.info(
                    "session %s expired after %.0f s idle", session.session_id, now - session.last_used_at
                )
                await self.close(session)
        if not durable.catalog.shared:
            await self._expire_responses(now)
        elif await self.leases.duty(EXPIRY_DUTY, settings.sweep_interval):
            if settings.persistent_ttl > 0:
                await self._expire_unheld(now - settings.persistent_ttl)
            await self._expire_responses(now)
        shared_store = durable.catalog.shared and durable.store.remote
        if shared_store and await self.leases.duty(COLLECTOR_DUTY, settings.sweep_interval):
            try:
                await asyncio.to_thread(collect, durable.store, durable.catalog)
            except KvkeepError as e:
                log.warning("orphaned blocks were not collected: %s", e)
        await self.residency.enforce_ram()
        await asyncio.to_thread(durable.sweep, settings.disk_budget, self.stores.disk.used)

    async def _expire_unheld(self, idle_before: float) -> None:
        """Delete the shared catalog's persistent sessions idle since before `idle_before`
        that no daemon holds (those held, here or elsewhere, their holder expires). Run by
        the holder of the expiry duty; the catalog would delete each once all the same,
        whichever daemons asked."""
        try:
            expired = await asyncio.to_thread(
                self.stores.durable.catalog.expire_sessions, idle_before, EXPIRED_PER_SWEEP
            )
        except KvkeepError as e:
            log.warning("idle sessions in the shared catalog were not expired: %s", e)
            return
        for session_id in expired:
            log.info("session %s expired in the shared catalog (idle, held by no daemon)", session_id)

    async def _expire_responses(self, now: float) -> None:
        try:
            await self.expire_responses(now)
        except KvkeepError as e:
            log.warning("stored responses were not expired: %s", e)
        try:
            await self.expire_prefixes(now)
        except KvkeepError as e:
            log.warning("kept prefixes were not expired: %s", e)

    async def run(self) -> None:
        """Sweep every `sweep_interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("the sweeper failed; it will try again")
            self.host.publish()
