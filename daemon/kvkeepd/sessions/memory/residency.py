"""Residency: where each session's computed state lives, and the only code that moves it.

A session's state is in exactly one place, one `Placement` value:

- `InSlot`: in an engine slot (hot);
- `Docked`: in a dock, a KV stream beside the slots (device memory on a GPU), after eviction,
  which a device-to-device copy moves back into a slot (warm; engine/streams.py);
- `Parked`: parsed and checked, in RAM (warm), after eviction, a restore or a fork;
- `Stored`: in a checkpoint store (cold): a persistent session's head after a restart or a
  spill, or an ephemeral session's spill (a disk area wiped at every start);
- `HistoryOnly`: only the token history; the next generation evaluates it again.

Moves into and out of slots are single engine commands (see engine.py), and they run inside
operations that finish once started (ops.py), so every move ends with its bookkeeping done:
a failed move leaves the session history-only (with its error) and the slot free. The slot
table holds a session exactly while its placement is `InSlot` (and, during a load, while
the slot is reserved for it). Callers hold the session's lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from kvkeepd.config.settings import Settings
from kvkeepd.engine.engine import Engine
from kvkeepd.errors import Busy, CorruptCheckpoint, KvkeepError
from kvkeepd.sessions import ops
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.ledger import Ledger
from kvkeepd.sessions.lineage import Lineage
from kvkeepd.sessions.placement import Docked, HistoryOnly, InSlot, Parked, Placements, Stored
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenants
from kvkeepd.sessions.whole_states import StateCache
from kvkeepd.state import cells as kvstate
from kvkeepd.state import pieces
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage.budget import state_bound
from kvkeepd.storage.stores import Stores
from kvkeepd.storage.writes import store_write

log = logging.getLogger(__name__)

T = TypeVar("T")


class Residency(Placements):
    """Every session's placement and the slot and dock tables (Placements), and the moves."""

    def __init__(
        self,
        engine: Engine,
        settings: Settings,
        stores: Stores,
        persistence: Persistence,
        tenants: Tenants,
        ledger: Ledger,
    ) -> None:
        super().__init__(engine.streams)
        self.engine = engine
        self.settings = settings
        self.durable = stores.durable
        self.spill_store = stores.spill
        # Ephemeral sessions' checkpoints: in RAM, so under --ram-cache too.
        self.volatile = stores.volatile
        self.disk = stores.disk
        self.persistence = persistence
        # Their RAM quotas (SIGHUP may change them).
        self.tenants = tenants
        self._slot_freed = asyncio.Event()
        # Which checkpoints each session's cells still are (rewind_to).
        self.lineage = Lineage()
        # Ephemeral checkpoints' whole states, in the RAM budget's free room.
        self.wholes = StateCache()
        self.waiting = 0
        self.rewinds = 0
        # Where swap-ins are counted.
        self.ledger = ledger

    def ram_bytes(self) -> int:
        """Bytes in RAM that --ram-cache bounds: parked states, recurrent snapshots, ephemeral
        sessions' checkpoints (blocks and manifests) and the spill area's manifests. The
        whole states of `wholes` fill what is left, and give way to these."""
        total = self.parked_bytes() + self.spill_store.catalog.manifest_bytes
        return total + self.volatile.store.total_bytes() + self.volatile.catalog.manifest_bytes

    # ---- moves ----------------------------------------------------------------------------------

    async def into_slot(self, session: Session) -> int:
        """Give the session a slot and load its state there (a free slot, or the one of the
        least recently used idle session, which is parked first). A stored state is read
        only once the slot is the session's, so it never waits in RAM."""
        where = self.where(session)
        if isinstance(where, InSlot):
            return where.slot
        slot = await self._free_slot(session)
        state = session.state
        self._slots[slot] = session  # reserved while its state is read and loaded
        started = time.perf_counter()
        kv: kvstate.SeqKv | None = None
        docked = False
        try:
            where = self.where(session)
            if isinstance(where, Docked):
                place, docked = where.place, True
                try:
                    await self._engine(lambda e: e.move(self.streams.dock_id(place), slot))
                finally:
                    self.docks.vacate(place)
            else:
                if isinstance(where, Stored):
                    kv = await self._read_stored(session)
                elif isinstance(where, Parked):
                    kv = where.kv
                await self._engine(lambda e: e.load(slot, state, kv))
        except BaseException as e:
            self._slots[slot] = None
            self._slot_freed.set()
            await self._drop_spill(session)
            self._set(session, HistoryOnly(str(e)))
            raise
        await self._drop_spill(session)  # a spilled state is the slot's now
        self._set(session, InSlot(slot))
        if kv is not None or docked:
            self.ledger.swap_in(session.tenant, time.perf_counter() - started)
        return slot

    async def release(self, session: Session, *, park: bool = True) -> None:
        """Take the session out of its slot; with park, its state moves to a dock where the
        engine has one free (or frees one: its least recently used session goes to RAM), else
        to RAM (room made first), or straight to disk when the RAM budget cannot take it.
        Without park, a docked session's dock is emptied too."""
        match self._where.get(session.session_id, (session, None))[1]:
            case InSlot(slot):
                if park and await self._dock(session, slot):
                    return
                await self._unload(session, slot, park, lambda: self._vacate(slot))
            case Docked(place) if not park:
                seq = self.engine.streams.dock_id(place)
                await self._unload(session, seq, False, lambda: self.docks.vacate(place))

    def _vacate(self, slot: int) -> None:
        self._slots[slot] = None
        self._slot_freed.set()

    async def _unload(self, session: Session, seq: int, park: bool, vacate: Callable[[], None]) -> None:
        """Empty the engine sequence (a slot or a dock) that holds the session's cells; with
        park, its state moves to RAM, or to disk when the RAM budget cannot take it."""
        layout = self.engine.layout
        keep = park and layout is not None
        state = session.state
        room = keep and layout is not None and await self.make_room(layout.max_bytes(state.n_kv), session)
        kv: kvstate.SeqKv | None = None
        try:
            kv = await self._engine(lambda e: e.unload(seq, state, keep))
        finally:  # the sequence is free whatever happened (the engine clears it in any case)
            vacate()
            self._set(session, Parked(kv) if kv is not None else HistoryOnly())
        if kv is not None and not room:
            await self._spill(session)

    async def _dock(self, session: Session, slot: int) -> bool:
        """Move the slot's session to a dock, freeing one if all are taken; False (nothing
        changed) where there are none, or none can be freed without waiting."""
        if not len(self.docks) or self.engine.layout is None or not session.state.n_kv:
            return False
        place = self.docks.free_place()
        if place is None:
            victim = self.docks.victim(keep=session)
            if victim is None:
                return False
            async with victim.lock:  # idle: taking it does not wait
                where = self.where(victim)
                if not victim.closed and isinstance(where, Docked):
                    seq = self.engine.streams.dock_id(where.place)
                    await self._unload(victim, seq, True, lambda: self.docks.vacate(where.place))
            place = self.docks.free_place()
            if place is None:
                return False
        to = place
        moved = False
        try:
            await self._engine(lambda e: e.move(slot, self.streams.dock_id(to)))
            moved = True
        finally:  # a failed move left both streams empty (Engine.move)
            self._vacate(slot)
            if moved:
                self.docks.hold(to, session)
            self._set(session, Docked(to) if moved else HistoryOnly("its move to a dock failed"))
        return True

    async def forget(self, session: Session) -> None:
        """Free whatever the session's state holds (a slot, RAM, a spill) and stop tracking it."""
        await self.release(session, park=False)
        await self._drop_spill(session)
        self._where.pop(session.session_id, None)
        self.lineage.forget(session)

    async def replace(self, session: Session, snap: Snapshot, kv: kvstate.SeqKv | None) -> None:
        """The session's history and state become a checkpoint's (restore, fork). The state
        is parked if the RAM budget can make room for it, else stored on disk; Busy, before
        anything changes, if neither has room."""
        to_disk = False
        if kv is not None and not await self.make_room(kv.nbytes, session):
            bound = state_bound(kv.nbytes, len(snap.tokens), self.durable.n_vocab)
            if not await asyncio.to_thread(self.disk.fits, bound):
                raise Busy(
                    "neither the RAM cache nor the disk budget has room for this state: close "
                    "sessions or delete checkpoints"
                )
            to_disk = True
        await self.drop_state(session)
        session.apply(snap, kv.n if kv is not None else 0)
        self._set(session, Parked(kv) if kv is not None else HistoryOnly())
        if to_disk:
            await self._spill(session)

    async def drop_state(self, session: Session, why: str = "") -> None:
        """Let the session's state go, wherever it is: the next generation evaluates its
        history again."""
        await self.release(session, park=False)
        await self._drop_spill(session)
        self._set(session, HistoryOnly(why))

    async def assemble_parked(self, session: Session) -> None:
        """Assemble a parked state read from blocks into the blob llama.cpp takes, in a
        worker thread, so that its load into a slot only copies that in. Worth it beside
        a wait such as a head save's sync, which it overlaps. Only where the blob is the
        state as parsed (cells at their positions, no window to place); otherwise the
        load assembles it, as before."""
        where = self.where(session)
        layout = self.engine.layout
        if not isinstance(where, Parked) or layout is None:
            return
        if where.kv.raw is not None or where.kv.window_from:
            return
        # Allocated here, on the event loop's thread, where it is also freed after its load:
        # glibc then reuses one arena's freed blob instead of keeping one per worker thread.
        into = np.empty(pieces.blob_size(where.kv), dtype=np.uint8)
        kv = await asyncio.to_thread(pieces.assembled, where.kv, layout, into)
        if kv is not None and self.where(session) is where:  # (the caller holds its lock)
            self._set(session, Parked(kv))

    async def save_head(self, session: Session) -> tuple[str, Snapshot]:
        """Save a persistent session's head with its state as it is now (Persistence.save_head)."""
        return await self.persistence.save_head(session, await self.state_of(session))

    async def state_of(self, session: Session, *, rounded: bool = False) -> kvstate.SeqKv | None:
        """The session's state as it is now (exported from its slot if hot), for a save
        (rounded: an export every turn, see heap.state_buffer)."""
        where = self.where(session)
        if isinstance(where, Stored):
            return await self._read_stored(session)  # read for a save; it stays where it is
        state = session.state
        seq = self.stream(session)
        if seq is not None:
            if self.engine.layout is None or not state.n_kv:
                return None
            return await self._engine(lambda e: e.export(seq, state, rounded=rounded))
        return where.kv if isinstance(where, Parked) else None

    # ---- rollbacks that keep the cells ------------------------------------------------------

    async def rewind_to(
        self, session: Session, checkpoint_id: str, snap: Snapshot, layout_desc: str | None
    ) -> bool:
        """Make the session the checkpoint's without loading its state, where the session's
        own cells already are that state: the checkpoint was saved from this session, its
        cells have not been taken away since (same epoch), and its tokens are a prefix of
        the session's. The slot (or the parked state) is cut to the checkpoint's length.
        False where that is not exact: a recurrent state (it cannot be cut), a sliding
        window that no longer holds the cells the cut needs, another layout; the caller then
        loads the checkpoint."""
        state = session.state
        where = self.where(session)
        layout = self.engine.layout
        n = snap.n_kv
        if (
            not self.lineage.holds(session, checkpoint_id, n)
            or not isinstance(where, InSlot | Docked | Parked)
            or layout is None
            or layout.recurrent is not None
            or snap.kv_layout is None
            or snap.kv_layout != layout_desc
            or not 0 < n <= state.n_kv
            or snap.tokens[:n] != state.tokens[:n]
            or not pieces.can_cut(layout, state.window_from, n)
        ):
            return False
        window_from, epoch = state.window_from, state.epoch
        seq = self.stream(session)
        if seq is not None:
            try:
                await self._engine(lambda e: e.cut(seq, state, n))
            except KvkeepError:
                log.exception("session %s: a rollback in place failed; loading instead", session.session_id)
                return False
        elif isinstance(where, Parked):
            kv = pieces.head(where.kv, n)
            if kv is None:  # the parked window does not hold [first(n), n)
                return False
            self._set(session, Parked(kv))
        session.apply(snap, n)
        session.state.window_from = window_from
        # The cells below n are the same bytes: what agreed with them still does.
        self.lineage.cut(session, epoch, n)
        self.rewinds += 1
        return True

    async def truncate(self, session: Session, n_tokens: int) -> None:
        """Keep the first n_tokens of history, and a state to match (see Engine.truncate)."""
        session.forget_snapshots_after(n_tokens)
        snapshots = tuple(session.snapshots)
        state = session.state
        if isinstance(self.where(session), Stored):
            await self._warm(session)
        where = self.where(session)
        seq = self.stream(session)
        if seq is not None:
            await self._engine(lambda e: e.truncate(seq, state, n_tokens, snapshots))
            return
        del state.tokens[n_tokens:]
        if not isinstance(where, Parked) or state.n_kv < n_tokens:
            return
        if state.n_kv == n_tokens and state.logits is not None:
            return
        kv = pieces.rewind(where.kv, max(n_tokens - 1, 0), snapshots)
        state.logits = None
        state.n_kv = kv.n if kv is not None else 0
        self._set(session, Parked(kv) if kv is not None else HistoryOnly())

    # ---- slots --------------------------------------------------------------------------------

    async def _free_slot(self, session: Session) -> int:
        if self.waiting >= self.settings.max_queue:
            raise Busy("too many requests are waiting for a slot; try again later")
        self.waiting += 1
        try:
            while (slot := self._first_free()) is None:
                victim = self._victim()
                if victim is not None:
                    # Idle, so taking its lock does not wait, unless a request for it is
                    # queued: that one goes first, and may close it or keep its slot.
                    async with victim.lock:
                        if not victim.closed:
                            await self.release(victim, park=True)
                    await self.enforce_ram(keep=session)
                    continue
                self._slot_freed.clear()
                async with ops.current().waiting():
                    await self._slot_freed.wait()
        finally:
            self.waiting -= 1
        return slot

    def _first_free(self) -> int | None:
        return next((i for i, s in enumerate(self._slots) if s is None), None)

    def _victim(self) -> Session | None:
        idle = [s for s in self._slots if s is not None and not s.busy and isinstance(self.where(s), InSlot)]
        return min(idle, key=lambda s: s.last_used_at) if idle else None

    def slot_freed(self) -> None:
        """A session went idle: requests waiting for a slot may now evict it."""
        self._slot_freed.set()

    # ---- RAM and disk tiers ---------------------------------------------------------------------

    async def enforce_ram(self, keep: Session | None = None) -> None:
        """Spill parked state to disk, least recently used first, while over the RAM budget;
        and a tenant's, while over its own quota (never another tenant's for it)."""
        for tenant in {s.tenant for s, _ in self._where.values()}:
            limit = self.tenants.get(tenant).quota.max_parked_bytes
            if limit:
                while self.parked_bytes(tenant) > limit:
                    if not await self._spill_one(keep, tenant):
                        break
        await self.make_room(0, keep)

    async def make_room(self, n: int, keep: Session | None = None) -> bool:
        """Spill idle parked state, least recently used first, until `n` more bytes fit
        under the RAM budget; False if they cannot (nothing idle is left to spill)."""
        budget = self.settings.ram_cache
        if n > budget:
            return False
        self.wholes.shrink(budget - self.ram_bytes() - n)
        while self.ram_bytes() + n > budget:
            if not await self._spill_one(keep, None):
                return False
        return True

    def keep_whole(self, checkpoint_id: str, session: Session, kv: kvstate.SeqKv | None) -> None:
        """Keep the whole state of an ephemeral session's new checkpoint where the RAM budget
        has room for it (see sessions/whole_states.py)."""
        if kv is not None and not session.persistent:
            self.wholes.put(checkpoint_id, session.session_id, kv, self.settings.ram_cache - self.ram_bytes())

    def keep_response(self, checkpoint_id: str, kv: kvstate.SeqKv | None) -> None:
        """Keep a stored response's whole state where the RAM budget has room for it, so
        that a branch from it loads it as it is: it outlives the session it was saved from
        (its own owner), and goes when the response is deleted or RAM needs the room."""
        if kv is not None:
            self.wholes.put(checkpoint_id, checkpoint_id, kv, self.settings.ram_cache - self.ram_bytes())

    async def reserve_ram(self, n: int, keep: Session, what: str) -> None:
        """Make room for `n` bytes of RAM, or Busy naming `what` would not fit."""
        if not await self.make_room(n, keep):
            raise Busy(
                f"the RAM cache of {self.settings.ram_cache} bytes has no room for {what} "
                f"({n} bytes): delete checkpoints or close sessions"
            )

    async def _spill_one(self, keep: Session | None, tenant: str | None) -> bool:
        """Spill the least recently used idle parked session (of `tenant`, or any); False if
        there is none."""
        idle = [
            s
            for s, where in self._where.values()
            if isinstance(where, Parked)
            and not s.busy
            and s is not keep
            and (tenant is None or s.tenant == tenant)
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used_at)
        async with victim.lock:
            if not victim.closed:
                await self._spill(victim)
        return True

    async def _spill(self, session: Session) -> None:
        """Parked state to disk: a persistent session's head, or the spill area. Where the
        disk has no room either (or fails), the state is dropped: the history stays, and
        the next generation evaluates it again."""
        where = self.where(session)
        if not isinstance(where, Parked):
            return
        session.snapshots = []
        try:
            if session.persistent:
                checkpoint_id, stored = await self.persistence.save_head(session, where.kv)
                ref = Stored(self.durable, checkpoint_id, stored)
                # Nothing of it is left here but its head: another daemon may take it at once.
                self.persistence.leases.let_go(session.session_id)
            else:
                snap = session.snapshot("", self.settings.block_tokens)
                row, stored = await store_write(
                    self.spill_store.save, snap, where.kv, kind="spill", now=time.time()
                )
                ref = Stored(self.spill_store, row.checkpoint_id, stored)
        except KvkeepError as e:
            log.warning("session %s: its state is dropped, not spilled: %s", session.session_id, e)
            self._set(session, HistoryOnly(str(e)))
            return
        self._set(session, ref if ref.snapshot.n_kv == session.state.n_kv else HistoryOnly())

    async def _read_stored(self, session: Session) -> kvstate.SeqKv | None:
        """A stored state read back (its placement unchanged), or None if it cannot be used
        here (then the session is history-only). A damaged block fails the request with
        DATA_LOSS and leaves the session history-only: the next request evaluates again."""
        ref = self.where(session)
        assert isinstance(ref, Stored)
        try:
            # Read into memory allocated here, on the event loop's thread (see read_buffer).
            kv, _ = await asyncio.to_thread(
                ref.store.cells, ref.snapshot, ref.store.read_buffer(ref.snapshot)
            )
        except CorruptCheckpoint as e:
            await self._drop_spill(session)
            self._set(session, HistoryOnly(str(e)))
            raise
        except KvkeepError as e:
            kv = None
            log.warning("session %s: its stored state is not used: %s", session.session_id, e)
        if kv is None or kv.n != session.state.n_kv:
            await self._drop_spill(session)
            self._set(session, HistoryOnly("the stored state does not fit this daemon"))
            return None
        return kv

    async def _warm(self, session: Session) -> None:
        """A stored state back into RAM (Parked), room made first, or history-only if it
        cannot be used."""
        kv = await self._read_stored(session)
        if kv is None:
            return
        await self.make_room(kv.nbytes, session)
        await self._drop_spill(session)
        self._set(session, Parked(kv))

    async def _drop_spill(self, session: Session) -> None:
        where = self._where.get(session.session_id, (session, HistoryOnly()))[1]
        if isinstance(where, Stored) and where.store is self.spill_store:
            self._where[session.session_id] = (session, HistoryOnly())
            await asyncio.to_thread(self.spill_store.delete, where.checkpoint_id)
            await asyncio.to_thread(self.spill_store.sweep, 0)

    async def _engine(self, fn: Callable[[Engine], T]) -> T:
        return await asyncio.wrap_future(self.engine.call(fn))
