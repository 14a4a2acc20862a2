"""The RPC flows around checkpoints: take, list, restore, fork, delete, export and import.

Each runs as an operation that finishes once started (ops.py), holding the lock of the
session it changes; the Residency places restored and forked state, the Persistence stores
and reads it.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from kvkeepd.config.settings import Settings
from kvkeepd.engine.context import ModelInfo
from kvkeepd.errors import Busy, CheckpointInUse, InvalidRequest
from kvkeepd.request_limits import IMPORTS_CHECKED, MAX_IMPORTS, MAX_LABEL
from kvkeepd.sessions import ops as opsmod
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.flows.head_saves import save_or_put_back
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.state import cells as kvstate
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage import exports
from kvkeepd.storage.catalog import CheckpointRow
from kvkeepd.storage.writes import store_write

_CHECKPOINT_ID = re.compile(r"^c_[0-9a-f]{24}$")


class Checkpointing:
    """The checkpoint flows of the sessions a SessionHost holds."""

    def __init__(
        self,
        host: SessionHost,
        *,
        settings: Settings,
        model: ModelInfo,
        residency: Residency,
        persistence: Persistence,
    ) -> None:
        self.host = host
        self.settings = settings
        self.model = model
        self.residency = residency
        self.persistence = persistence
        self._imports = 0
        # Each import being checked holds a whole state in memory.
        self._checking = asyncio.Semaphore(IMPORTS_CHECKED)

    async def checkpoint(self, session_id: str, tenant: Tenant, label: str) -> CheckpointRow:
        """An immutable, labelled checkpoint of the session as it is now."""
        session = await self.host.find(session_id, tenant)
        if len(label) > MAX_LABEL:
            raise InvalidRequest(f"labels have at most {MAX_LABEL} characters")
        return await self.host.ops.run(self._checkpoint(tenant, session, label))

    async def _checkpoint(self, tenant: Tenant, session: Session, label: str) -> CheckpointRow:
        async with self.host.use(session):
            if session.persistent:
                await self.persistence.check_disk()
                await self.persistence.check_stored(tenant)
            kv = await self.residency.state_of(session)
            if not session.persistent:  # its blocks and manifest stay in RAM
                bound = self.persistence.ram_bound(session, kv)
                await self.residency.reserve_ram(bound, session, "this checkpoint")
            row = await self.persistence.checkpoint(session, kv, label)
            self.residency.keep_whole(row.checkpoint_id, session, kv)
            self.residency.lineage.remember(session, row.checkpoint_id)
            return row

    async def list_checkpoints(self, session_id: str, tenant: Tenant) -> list[CheckpointRow]:
        """A session's checkpoints, or with no session_id all of the tenant's (imports too)."""
        if not session_id:
            return await self.persistence.tenant_checkpoints(tenant)
        session = await self.host.find(session_id, tenant)
        return await asyncio.to_thread(self.persistence.store_of(session).catalog.checkpoints, session_id)

    def _check_checkpoint_id(self, checkpoint_id: str) -> None:
        if not _CHECKPOINT_ID.match(checkpoint_id):
            raise InvalidRequest(f"malformed checkpoint id: {checkpoint_id[:80]!r}")

    async def restore(self, session_id: str, checkpoint_id: str, tenant: Tenant) -> tuple[Session, bool]:
        """Roll the session back to a checkpoint. Returns (session, history evaluated again)."""
        session = await self.host.find(session_id, tenant)
        self._check_checkpoint_id(checkpoint_id)
        return await self.host.ops.run(self._restore(session, checkpoint_id, tenant))

    async def _restore(self, session: Session, checkpoint_id: str, tenant: Tenant) -> tuple[Session, bool]:
        """A persistent session's restore is whole or nothing: its new head is saved, or the
        session is put back as it was (head_saves.py)."""
        store = await self.persistence.find(checkpoint_id, tenant)
        snap = None
        if self.residency.lineage.remembers(session, checkpoint_id):
            # One of the session's own checkpoints: its cells may still be in the session.
            async with self.host.use(session):
                snap = await asyncio.to_thread(store.snapshot, checkpoint_id)
                before = session.before()
                if await self.residency.rewind_to(session, checkpoint_id, snap, store.layout_desc):
                    self.host.touch(session)
                    if session.persistent:
                        await save_or_put_back(self.residency, session, before, cells=True)
                    return session, False
        loaded = await self.persistence.load(checkpoint_id, tenant, store, snap, self.residency.wholes)
        async with self.host.use(session):
            before, head = session.before(), session.head_checkpoint_id
            await self.residency.replace(session, loaded.snapshot, loaded.kv)
            self.host.touch(session)
            # A state that went to disk (no room in RAM) was saved as the head already.
            if session.persistent and session.head_checkpoint_id == head:
                # The blob for the next turn's load is assembled while the head is synced.
                assembling = asyncio.ensure_future(self.residency.assemble_parked(session))
                try:
                    await save_or_put_back(self.residency, session, before, cells=False)
                finally:
                    await assembling
        return session, loaded.reprefill

    async def fork(
        self, session_id: str, checkpoint_id: str, persistent: bool, tenant: Tenant
    ) -> tuple[Session, bool]:
        """A new session that continues exactly as the source (a session or a checkpoint)."""
        if bool(session_id) == bool(checkpoint_id):
            raise InvalidRequest("fork from a session_id or from a checkpoint_id (one of them)")
        if checkpoint_id:
            self._check_checkpoint_id(checkpoint_id)
            return await self.host.ops.run(self._fork_checkpoint(checkpoint_id, persistent, tenant))
        source = await self.host.find(session_id, tenant)
        return await self.host.ops.run(self._fork_session(source, persistent, tenant))

    async def _fork_checkpoint(
        self, checkpoint_id: str, persistent: bool, tenant: Tenant
    ) -> tuple[Session, bool]:
        self.host.check_quota(tenant)
        loaded = await self.persistence.load(checkpoint_id, tenant, wholes=self.residency.wholes)
        salt = bytes.fromhex(loaded.snapshot.salt)
        child = await self._child(tenant, salt, loaded.snapshot, loaded.kv, persistent, [], checkpoint_id)
        return child, loaded.reprefill

    async def _fork_session(self, source: Session, persistent: bool, tenant: Tenant) -> tuple[Session, bool]:
        self.host.check_quota(tenant)
        async with self.host.use(source):
            kv = await self.residency.state_of(source)
            snap = source.snapshot("", self.settings.block_tokens)
            snapshots = list(source.snapshots)
            boundary = source.boundary
        child = await self._child(tenant, source.salt, snap, kv, persistent, snapshots, source.session_id)
        child.boundary, child.system_end = boundary, source.system_end
        return child, False

    async def _child(
        self,
        tenant: Tenant,
        salt: bytes,
        snap: Snapshot,
        kv: kvstate.SeqKv | None,
        persistent: bool,
        snapshots: list[kvstate.RecurrentCells],
        forked_from: str,
    ) -> Session:
        """A new session of `snap` with state `kv`, forked from `forked_from` (its first
        head says so)."""
        now = self.host.clock()
        child = Session(
            "s_" + secrets.token_hex(12),
            persistent,
            snap.params,
            snap.stop,
            now,
            now,
            tenant=tenant.name,
            salt=salt,
            forked_from=forked_from,
        )
        if persistent:
            await self.persistence.check_disk()
            await self.persistence.check_stored(tenant)
        self.residency.add(child)
        try:
            await self.residency.replace(child, snap, kv)
            child.snapshots = snapshots
            if persistent:
                await self.residency.save_head(child)
        except BaseException:
            # Forgotten here, as no client learns its id.
            await self.residency.forget(child)
            if persistent:
                await self.persistence.leases.release(child.session_id)
            raise
        self.host.register(child)
        return child

    async def delete_checkpoint(self, checkpoint_id: str, tenant: Tenant) -> None:
        self._check_checkpoint_id(checkpoint_id)
        store = await self.persistence.find(checkpoint_id, tenant)
        if any(s.head_checkpoint_id == checkpoint_id for s in self.host.sessions.values()):
            raise CheckpointInUse("that checkpoint is a live session's head; close the session")
        await store_write(store.delete, checkpoint_id)
        self.residency.wholes.drop(checkpoint_id)

    async def export_checkpoint(self, checkpoint_id: str, tenant: Tenant) -> AsyncIterator[bytes]:
        """The checkpoint's export, read from the store one chunk (1 MiB) at a time as the
        client takes them."""
        self._check_checkpoint_id(checkpoint_id)
        store = await self.persistence.find(checkpoint_id, tenant)
        chunks = exports.export(store, checkpoint_id)
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            yield chunk

    async def import_checkpoint(self, chunks: AsyncIterator[bytes], tenant: Tenant) -> CheckpointRow:
        """Store an exported checkpoint as one of the tenant's own (CheckpointStore.import_file).

        The stream goes to an unnamed temporary file as it arrives (nothing of it outlives
        the request, even a crash), so memory holds one chunk of it; at most MAX_IMPORTS
        are received at once (Busy beyond) and IMPORTS_CHECKED checked at once."""
        layout = self.model.layout
        state_bytes = layout.max_bytes(self.model.n_ctx_seq) if layout is not None else 0
        limit = 2 * state_bytes + (64 << 20)
        if self._imports >= MAX_IMPORTS:
            raise Busy(f"{MAX_IMPORTS} imports are under way; try again later")
        self._imports += 1
        try:
            with await asyncio.to_thread(_spool, self.settings.state_dir) as spool:
                size = 0
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise InvalidRequest(f"the import exceeds {limit} bytes")
                    await asyncio.to_thread(spool.write, chunk)
                await asyncio.to_thread(spool.flush)
                return await self.host.ops.run(self._import(spool, tenant))
        finally:
            self._imports -= 1

    async def _import(self, spool: BinaryIO, tenant: Tenant) -> CheckpointRow:
        async with opsmod.current().waiting():
            await self._checking.acquire()
        try:
            return await self.persistence.import_checkpoint(spool, tenant)
        finally:
            self._checking.release()


def _spool(directory: Path) -> BinaryIO:
    """An unnamed temporary file in `directory` (gone when closed, or when the process dies)."""
    return tempfile.TemporaryFile("w+b", dir=directory)
