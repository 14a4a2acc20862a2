"""Kept prefixes: a conversation's computed state up to a point its client marked (the
Messages API's `cache_control` breakpoints), kept in the durable store for a time given,
where the prefix cache finds it.

A kept prefix is a checkpoint (kind "prefix", labelled with its time to live in seconds)
of the first tokens of a session's history, cut to the block grid: the prefix cache
attaches whole blocks. Its blocks are keyed under the session's salt, so only sessions of
the same tenant or the same cache salt find them (prefix_cache.py); they count in the
tenant's stored-bytes quota and the disk budget like any checkpoint's. Its id follows from
the tenant, the salt and the tokens, so the same prefix kept again is the same checkpoint:
kept again, its time to live counts from then, and nothing new is stored. It outlives the
session that made it and the daemon (its blocks are on disk, or in the shared store), and
the sweeper deletes it once its time is up. Models whose state cannot be cut anywhere
(sliding windows, recurrent state) keep none.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kvkeepd.config.settings import Settings
from kvkeepd.engine.context import ModelInfo
from kvkeepd.errors import InvalidRequest, NotFound
from kvkeepd.sessions.durability.persistence import Persistence
from kvkeepd.sessions.host import SessionHost
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.prompting.tokens import Tokenizer
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant
from kvkeepd.state import pieces
from kvkeepd.storage.checkpoints import CHECKPOINT_ID_PREFIX
from kvkeepd.storage.writes import store_write
from kvkeepd.values.messages import Message

log = logging.getLogger(__name__)

#: Kept prefixes one sweep deletes.
EXPIRED_PER_SWEEP = 100
#: A prefix kept again within this many seconds of its last keeping is not written again
#: (its manifest would be, for a minute more of life).
REFRESH_AFTER = 60.0


class KeptPrefixes:
    """Keeps marked prefixes of the sessions a SessionHost holds, and expires them."""

    def __init__(
        self,
        host: SessionHost,
        *,
        settings: Settings,
        model: ModelInfo,
        tokens: Tokenizer,
        residency: Residency,
        persistence: Persistence,
    ) -> None:
        self.host = host
        self.settings = settings
        self.model = model
        self.tokens = tokens
        self.residency = residency
        self.persistence = persistence
        self.durable = persistence.durable

    async def keep(
        self, session_id: str, tenant: Tenant, prefixes: Sequence[Sequence[Message]], ttl: float
    ) -> int:
        """Keep the session's state at the end of each prefix of its conversation (messages
        as the chat template renders them, without a reply's opening) for `ttl` seconds at
        least. Returns the tokens of the longest prefix newly stored (0: none was: each was
        kept already, or none reaches a whole block, or the model's state cannot be cut)."""
        session = await self.host.find(session_id, tenant)
        layout = self.model.layout
        if not self.settings.prefix_cache or layout is None or layout.partial or session.imported:
            return 0
        wanted: list[list[int]] = []
        for messages in prefixes:
            try:
                segments = await self.tokens.render(messages, False, session.tools)
            except InvalidRequest:  # a template that renders no such prefix: none is kept there
                continue
            wanted.append(await self.tokens.segments(segments, first=True))
        return await self.host.ops.run(self._keep(session, tenant, wanted, ttl))

    async def _keep(self, session: Session, tenant: Tenant, wanted: list[list[int]], ttl: float) -> int:
        block = self.settings.block_tokens
        async with self.host.use(session):
            history = session.state.tokens
            cuts = sorted({_common(w, history, session.state.n_kv) // block * block for w in wanted} - {0})
            now = self.host.clock()
            fresh: list[tuple[int, str, bool]] = []  # (tokens, id, new)
            for n in cuts:
                checkpoint_id = _checkpoint_id(tenant, session.salt, history[:n])
                found = await asyncio.to_thread(self.durable.catalog.get, checkpoint_id)
                if found is not None:
                    row = found[0]
                    if row.created_at + float(row.label) >= now + ttl - REFRESH_AFTER:
                        continue
                    with contextlib.suppress(NotFound):  # its blocks stay: the save claims them
                        await store_write(self.durable.delete, checkpoint_id)
                fresh.append((n, checkpoint_id, found is None))
            if not fresh:
                return 0
            await self.persistence.check_disk()
            await self.persistence.check_stored(tenant)
            kv = await self.residency.state_of(session)
            if kv is None:
                return 0
            stored = 0
            for n, checkpoint_id, new in fresh:
                snap = replace(
                    session.snapshot(str(int(ttl)), block),
                    session_id="",
                    tokens=history[:n],
                    n_kv=n,
                    logits=None,
                    messages=[],
                    constraint=None,
                    system_end=min(session.system_end, n),
                )
                cut = pieces.head(kv, n)
                await store_write(
                    self.durable.save, snap, cut, kind="prefix", now=now, checkpoint_id=checkpoint_id
                )
                stored = max(stored, n if new else 0)
            return stored

    async def expire(self, now: float) -> int:
        """Delete kept prefixes whose time is up (run by the sweeper, within its operation),
        with the blocks only they referenced; returns how many."""
        expired = await asyncio.to_thread(self.durable.catalog.expired_prefixes, now, EXPIRED_PER_SWEEP)
        n = 0
        for checkpoint_id in expired:
            with contextlib.suppress(NotFound):
                await store_write(self.durable.delete_with_blocks, checkpoint_id)
                n += 1
        if n:
            log.info("%d kept prefixes expired", n)
        return n


def _common(wanted: list[int], history: list[int], n_kv: int) -> int:
    """How many of `wanted`'s first tokens the history begins with, within its computed
    state."""
    n = min(len(wanted), len(history), n_kv)
    differ = np.flatnonzero(np.asarray(wanted[:n], dtype=np.int64) != np.asarray(history[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


def _checkpoint_id(tenant: Tenant, salt: bytes, tokens: list[int]) -> str:
    """The id of a tenant's kept prefix of these tokens under this salt."""
    digest = hashlib.sha256(tenant.name.encode() + b"\0" + salt + b"\0")
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return CHECKPOINT_ID_PREFIX + digest.hexdigest()[:24]
