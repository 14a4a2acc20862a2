"""Persistence: checkpoint stores, persistent sessions' heads, and sessions loaded at start.

A persistent session has a movable *head* manifest (its KV blocks and a manifest), saved
(delta) when it is created, rewound, restored or spilled, by a turn after which more than
`--head-interval` tokens would be evaluated again, and on graceful shutdown. Each turn in
between is made durable as a record in the turn journal (journal.py): the session's
manifest without its KV and logits, and the head it follows. After a restart the session
is listed and continues from its head, with the tokens its newest record adds pending
(evaluated again on its next request). Explicit checkpoints are separate, labelled,
immutable manifests. Ephemeral sessions keep their checkpoints in RAM; under memory
pressure their state may spill to a disk area wiped at every start, and nothing of them
outlives close, expiry or restart.
All catalog and file work runs in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import BinaryIO

from kvkeepd.config.settings import Settings
from kvkeepd.errors import Busy, CorruptCheckpoint, KvkeepError, NotFound, SessionElsewhere
from kvkeepd.sessions.durability.leases import Leases
from kvkeepd.sessions.placement import HistoryOnly, Placement, Stored
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.sessions.whole_states import StateCache
from kvkeepd.state import manifest as mf
from kvkeepd.state.cells import SeqKv
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage import exports
from kvkeepd.storage.budget import state_bound
from kvkeepd.storage.catalog import CheckpointRow
from kvkeepd.storage.checkpoints import CheckpointStore, Loaded
from kvkeepd.storage.stores import Stores
from kvkeepd.storage.writes import store_write

log = logging.getLogger(__name__)


class Persistence:
    """Saves and finds checkpoints for the session manager."""

    def __init__(
        self, stores: Stores, settings: Settings, clock: Callable[[], float], leases: Leases
    ) -> None:
        self.stores = stores
        self.durable = stores.durable
        self.volatile = stores.volatile
        self.journal = stores.journal
        self.settings = settings
        self.clock = clock
        self.leases = leases

    def store_of(self, session: Session) -> CheckpointStore:
        return self.durable if session.persistent else self.volatile

    async def save_head(self, session: Session, kv: SeqKv | None) -> tuple[str, Snapshot]:
        """Autosave a persistent session with its state `kv` (as Residency.state_of has it):
        its new head manifest, writing only new blocks."""
        if not session.lease:  # a new session: nobody else can hold it
            session.lease = await self.leases.take(session.session_id)
        snap = session.snapshot("", self.settings.block_tokens)
        snap.forked_from = session.forked_from  # a head's alone: checkpoints are not forks
        try:
            row, stored = await store_write(
                self.durable.save,
                snap,
                kv,
                kind="head",
                now=self.clock(),
                head_of=session.session_id,
                fence=session.lease,
                boundary=session.boundary,
            )
        except BaseException as e:
            session.head_unsure = True
            if isinstance(e, SessionElsewhere):
                self.leases.fenced(session.session_id)
            raise
        session.head_checkpoint_id = row.checkpoint_id
        session.dirty = session.head_unsure = False
        session.head_n_kv = stored.n_kv
        self.journal.forget(session.session_id)  # the head covers its turns
        return row.checkpoint_id, stored

    async def record_turn(self, session: Session) -> None:
        """Make a persistent session's turn durable: its record in the journal (the session
        as its manifest would record it, without KV or logits, and the head it follows).
        Returns once it is; StoreWriteFailed or Busy if it cannot be."""
        snap = session.snapshot("", self.settings.block_tokens)
        snap.forked_from = session.forked_from
        snap.logits = None
        snap.n_kv = 0
        snap.fingerprint = self.durable.fingerprint
        snap.saved_at = self.clock()
        body = turn_record(session.head_checkpoint_id, snap, self.durable.key)
        try:
            await self.journal.append(
                session.session_id, body, fence=session.lease, n_tokens=len(session.state.tokens)
            )
        except SessionElsewhere:
            self.leases.fenced(session.session_id)
            raise

    async def checkpoint(self, session: Session, kv: SeqKv | None, label: str) -> CheckpointRow:
        """An immutable, labelled checkpoint of the session with its state `kv` (an ephemeral
        one's in RAM: the caller has made room, `ram_bound`)."""
        snap = session.snapshot(label, self.settings.block_tokens)
        row, _ = await store_write(
            self.store_of(session).save,
            snap,
            kv,
            kind="explicit",
            now=self.clock(),
            boundary=session.boundary,
        )
        return row

    async def save_response(
        self, session: Session, kv: SeqKv | None, checkpoint_id: str, record: bytes
    ) -> CheckpointRow:
        """A stored response: the session's state `kv` as a durable checkpoint (kind
        "response", labelled with the response's id), committed with its record."""
        snap = session.snapshot("", self.settings.block_tokens)
        row, _ = await store_write(
            self.durable.save,
            snap,
            kv,
            kind="response",
            now=self.clock(),
            boundary=session.boundary,
            checkpoint_id=checkpoint_id,
            response=record,
        )
        return row

    def ram_bound(self, session: Session, kv: SeqKv | None) -> int:
        """The most RAM an ephemeral session's checkpoint with state `kv` takes."""
        n_bytes = kv.nbytes if kv is not None else 0
        return state_bound(n_bytes, len(session.state.tokens), self.volatile.n_vocab)

    async def find(self, checkpoint_id: str, tenant: Tenant) -> CheckpointStore:
        """The store that holds the tenant's checkpoint; NotFound if none does (another
        tenant's gets the same answer, by the same path: one lookup, then the owner)."""

        def lookup() -> CheckpointStore:
            for store in (self.durable, self.volatile):
                found = store.catalog.get(checkpoint_id)
                if found is not None and found[0].tenant == tenant.name:
                    return store
            raise NotFound(f"no checkpoint {checkpoint_id}")

        return await asyncio.to_thread(lookup)

    async def load(
        self,
        checkpoint_id: str,
        tenant: Tenant,
        store: CheckpointStore | None = None,
        snap: Snapshot | None = None,
        wholes: StateCache | None = None,
    ) -> Loaded:
        """The tenant's checkpoint, read and checked; `store`: where `find` found it, and
        `snap`: its manifest from that store, if known; `wholes`: where an ephemeral
        checkpoint's (or a stored response's) whole state may be kept (its blocks are then
        not read)."""
        store = store or await self.find(checkpoint_id, tenant)
        whole = wholes.get(checkpoint_id) if wholes is not None else None
        into = None
        if whole is None and store.reads_in_place:
            # Its blocks are read into memory allocated here, on the event loop's thread
            # (CheckpointStore.read_buffer says why).
            if snap is None:
                snap = await asyncio.to_thread(store.snapshot, checkpoint_id)
            into = store.read_buffer(snap)
        return await asyncio.to_thread(store.load, checkpoint_id, self.clock(), snap, whole, into)

    async def tenant_checkpoints(self, tenant: Tenant) -> list[CheckpointRow]:
        def rows() -> list[CheckpointRow]:
            found = self.durable.catalog.tenant_checkpoints(tenant.name)
            found += self.volatile.catalog.tenant_checkpoints(tenant.name)
            return sorted(found, key=lambda r: r.created_at)

        return await asyncio.to_thread(rows)

    async def check_stored(self, tenant: Tenant) -> None:
        """Busy when the tenant's stored bytes reach its quota: refused before any work.
        Each save then holds room for what it adds (CheckpointStore.save)."""
        limit = tenant.quota.max_stored_bytes
        if not limit:
            return
        used = await asyncio.to_thread(self.durable.catalog.stored_bytes, tenant.name)
        if used >= limit:
            raise Busy(
                f"the tenant's stored state holds {used} bytes, its quota is {limit}: delete "
                "checkpoints or close persistent sessions"
            )

    async def check_disk(self) -> None:
        """Refuse new persistent state when the disk budget is used up (Busy). Each write
        also reserves its own room (budget.py)."""
        disk = self.stores.disk

        def check() -> None:
            with disk.reserve(0):
                pass

        await asyncio.to_thread(check)

    async def delete_session(self, session: Session) -> None:
        """Forget a session's head and checkpoints, in one transaction: the commit point of
        a close."""
        store = self.store_of(session)
        try:
            await store_write(store.catalog.delete_session, session.session_id, session.lease)
        except SessionElsewhere:
            self.leases.fenced(session.session_id)
            raise
        if session.persistent:
            self.journal.forget(session.session_id, erase=True)
            self.leases.forget(session.session_id)
        else:
            await asyncio.to_thread(self.volatile.sweep, 0)

    async def import_checkpoint(self, spool: BinaryIO, tenant: Tenant) -> CheckpointRow:
        """Store an export (received into `spool`) as one of the tenant's checkpoints."""
        await self.check_disk()
        await self.check_stored(tenant)
        n_ctx = self.settings.ctx_per_session
        now = self.clock()
        return await store_write(
            exports.import_file, self.durable, spool, now, tenant=tenant.name, n_ctx=n_ctx
        )

    def load_persistent(
        self, new_session: Callable[[Snapshot, str], Session]
    ) -> list[tuple[Session, Placement]]:
        """Persistent sessions from the catalog, each with where its state is (blocking)."""
        out: list[tuple[Session, Placement]] = []
        records = self.journal.recovered()
        for session_id, _created, head in self.durable.catalog.sessions():
            if head is None:
                continue
            try:
                out.append(self.session_at(session_id, head, new_session, records.get(session_id)))
            except KvkeepError as e:
                log.error("persistent session %s is not loaded: %s", session_id, e)
                continue
        return out

    def session_at(
        self,
        session_id: str,
        head: str,
        new_session: Callable[[Snapshot, str], Session],
        record: bytes | None = None,
    ) -> tuple[Session, Placement]:
        """A persistent session as its head checkpoint has it, continued by its journal
        record (the turns since the head) where there is one, and where its state is
        (blocking)."""
        snap = self.durable.snapshot(head)
        turn = self._recorded_turn(session_id, head, record)
        if turn is not None and turn.fingerprint != snap.fingerprint:
            turn = None
        session = new_session(turn or snap, session_id)
        session.head_checkpoint_id = head
        session.head_n_kv = snap.n_kv
        if turn is not None:
            # The turns since the head: its state, and their tokens pending (evaluated
            # again on the next request, exactly as they were the first time).
            n_kv = _covered(snap, turn)
            session.apply(turn, n_kv)
            session.dirty = True
            if n_kv and snap.kv_layout == self.durable.layout_desc:
                return session, Stored(self.durable, head, snap)
            session.state.n_kv = 0
            return session, HistoryOnly("turns since the head change its history")
        session.apply(snap, snap.n_kv)
        if snap.n_kv and snap.kv_layout == self.durable.layout_desc:
            where: Placement = Stored(self.durable, head, snap)
        else:
            if snap.n_kv:
                log.info(
                    "session %s: its state has another layout; its history is evaluated again", session_id
                )
            session.state.n_kv = 0
            session.state.logits = None
            where = HistoryOnly("a stored state of another layout")
        return session, where

    def drop_stale_records(self, replayed: set[str], listed: set[str]) -> None:
        """Forget journal records found at start that no session continues from: covered by
        a head, or of a session that is gone (a close cut short before its record left the
        file; its text leaves now)."""
        for session_id in self.journal.recovered():
            if session_id not in replayed:
                self.journal.forget(session_id, erase=session_id not in listed)

    def _recorded_turn(self, session_id: str, head: str, body: bytes | None) -> Snapshot | None:
        """The session's newest journal record, if it follows its head (one older than the
        head is covered by it), checked like any manifest; None otherwise."""
        if body is None:
            return None
        try:
            base, snap = read_turn_record(body, self.durable.key, self.durable.n_vocab)
            if snap.session_id != session_id:
                raise CorruptCheckpoint("the record names another session")
            mf.check_limits(snap, self.settings.ctx_per_session)
        except (CorruptCheckpoint, KvkeepError) as e:
            log.error(
                "session %s: its journal record is not used (%s); it continues from its head", session_id, e
            )
            return None
        return snap if base == head else None


def turn_record(head: str, snap: Snapshot, key: bytes) -> bytes:
    """A journal record: the head it follows, then the manifest (with its HMAC)."""
    h = head.encode()
    return bytes([len(h)]) + h + mf.encode(snap, key)


def read_turn_record(body: bytes, key: bytes, n_vocab: int) -> tuple[str, Snapshot]:
    """(head, snapshot) of a journal record; CorruptCheckpoint unless it is intact."""
    if not body or len(body) < 1 + body[0]:
        raise CorruptCheckpoint("the journal record is truncated")
    try:
        head = body[1 : 1 + body[0]].decode("ascii")
    except UnicodeDecodeError:
        raise CorruptCheckpoint("the journal record's head is malformed") from None
    return head, mf.decode(body[1 + body[0] :], key, n_vocab)


def _covered(head: Snapshot, turn: Snapshot) -> int:
    """How much of the turn's history the head's state covers: its whole state when the
    turn's history extends the head's state (and leaves a token pending, for its logits),
    else nothing."""
    n = head.n_kv
    if n < len(turn.tokens) and turn.tokens[:n] == head.tokens[:n]:
        return n
    return 0
