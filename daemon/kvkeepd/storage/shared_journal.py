"""The shared turn journal: persistent sessions' turns made durable on the catalog's server.

With a shared catalog another daemon must be able to continue a session after its holder
dies, so a turn's record cannot stay in the holder's own file. It goes to the catalog's
Redis server instead, as the session's turn record (`P:turn:SID`, replacing the one before:
only the newest matters, as in the file journal), written by one script that checks the
writer's fencing token first: a daemon that lost the session's lease never writes its
record again, as it never writes its head again. The script that moves a head deletes the
record in the same step, so a record present always follows the current head.

Durability is the server's: run it with `appendonly yes` and `appendfsync always`, and
Redis writes and fsyncs its append-only log before it answers (the daemon warns at start
when it does not). Group commit happens twice: appends made while a round trip is in
flight go together in the next script call (one round trip for many sessions' turns), and
the server fsyncs once for all the writes of one pass of its event loop, whichever daemons
sent them.

After a holder's `kill -9` the next daemon takes the lease, reads the head and this record
(`record`), and continues exactly as the file journal's recovery does (persistence.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvkeepd.errors import SessionElsewhere
from kvkeepd.storage.catalog.redis import RedisCatalog
from kvkeepd.storage.journal import settle

log = logging.getLogger(__name__)


@dataclass
class _Append:
    key: str
    body: bytes
    fence: int
    n_tokens: int
    done: asyncio.Future[None]


class SharedJournal:
    """The TurnJournal protocol on a Redis catalog's server (see the module docstring)."""

    def __init__(self, catalog: RedisCatalog, clock: Callable[[], float]) -> None:
        self.catalog = catalog
        self.clock = clock
        # Round trips (each one script: the server's fsync covers it) and records made durable.
        self.syncs = 0
        self.records = 0
        self._pending: list[_Append] = []
        self._writer: asyncio.Task[None] | None = None
        self._closed = False
        settings = catalog.durability()
        if settings and (settings.get("appendonly") != "yes" or settings.get("appendfsync") != "always"):
            log.warning(
                "the catalog server %s does not fsync every write (appendonly %s, appendfsync %s): "
                "persistent turns it acknowledged may be lost if it crashes; run it with "
                "appendonly yes and appendfsync always",
                catalog.where,
                settings.get("appendonly", "?"),
                settings.get("appendfsync", "?"),
            )

    def recovered(self) -> dict[str, bytes]:
        """Nothing: with a shared catalog sessions are found on demand, with their records."""
        return {}

    def record(self, key: str) -> bytes | None:
        """The key's newest record as the server holds it now (blocking)."""
        return self.catalog.turn(key)

    async def append(self, key: str, body: bytes, *, fence: int = 0, n_tokens: int = 0) -> None:
        """Make `body` the key's record, durably, if `fence` is still the session's lease;
        SessionElsewhere if it is not (or the session is gone); CatalogUnavailable if the
        server does not answer (the record may or may not be kept: the turn is undone, and
        a record of an undone turn is never read, since the next turn replaces it and a
        head covers it)."""
        if self._closed:
            raise RuntimeError("the journal is closed")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_Append(key, body, fence, n_tokens, done))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())
        # The write goes on if this request is cancelled: its record lands or fails whole.
        await asyncio.shield(done)

    async def _write(self) -> None:
        """Write what is pending, one script per batch, until nothing is."""
        while self._pending:
            batch, self._pending = self._pending, []
            records = [(a.key, a.fence, a.n_tokens, a.body) for a in batch]
            try:
                kept = await asyncio.to_thread(self.catalog.append_turns, records, self.clock())
            except Exception as e:
                for a in batch:
                    settle(a.done, e)
                continue
            self.syncs += 1
            self.records += sum(kept)
            for a, ok in zip(batch, kept, strict=True):
                settle(a.done, None if ok else _elsewhere(a.key))

    def forget(self, key: str, *, erase: bool = False) -> None:
        """Nothing to do: the head save that covers a record deletes it in the same script,
        and closing or expiring a session deletes its record with it."""

    def file_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Refuse further appends (those in flight finish on their own)."""
        self._closed = True


def _elsewhere(session_id: str) -> SessionElsewhere:
    return SessionElsewhere(f"session {session_id} was taken over by another daemon; it continues there")
