"""The prefix cache: a session whose history begins with blocks already computed attaches
them instead of evaluating them.

A block's key is a hash chain over the tokens up to its end, started from the session's
salt (its tenant's, or a `cache_salt` it chose), so blocks are found only by sessions of the
same salt: nobody can probe another tenant's prompts, not even through timing. A session whose
state descends from an import (session.imported) keeps the import's salt and takes no part:
the cache offers only KV this daemon computed, and attaches nothing to imported state. Sources, the
longest prefix first: another live session's state (in its slot, or parked in RAM) whose
history begins the same way, and the block stores (persistent sessions' heads and
checkpoints on disk, which outlive restarts, and ephemeral checkpoints in RAM).

In exact mode every source holds the cells the session would compute itself (a token's cells
do not depend on how it was batched), so a session that attached a prefix continues exactly
as one that evaluated it; in compact mode the cells are as valid, not the same. At least the
last token of the history is always evaluated, for its logits. Sliding-window and recurrent
models attach only where the whole state at a block boundary exists: sessions keep it at
their system prompt's last block boundary (see `boundary_for`), and their saves store it
beside their blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import numpy as np

from kvkeepd.config.settings import Settings
from kvkeepd.engine.context import ModelInfo
from kvkeepd.engine.engine import Engine
from kvkeepd.errors import CorruptCheckpoint, StoreReadFailed
from kvkeepd.sessions.memory.residency import Residency
from kvkeepd.sessions.placement import Parked
from kvkeepd.sessions.session import Session
from kvkeepd.state import cells as kvstate
from kvkeepd.state import pieces
from kvkeepd.storage.checkpoints import CheckpointStore
from kvkeepd.storage.stores import Stores

log = logging.getLogger(__name__)


class PrefixCache:
    """Finds and builds cached prefixes for the generation flows."""

    def __init__(
        self,
        settings: Settings,
        model: ModelInfo,
        engine: Engine,
        stores: Stores,
        residency: Residency,
        live: Callable[[], Iterable[Session]],
    ) -> None:
        """`live`: the sessions whose state may be a source (the registered ones)."""
        self.settings = settings
        self.model = model
        self.engine = engine
        self.stores = stores
        self.residency = residency
        self.live = live

    async def find(self, session: Session, history: list[int]) -> kvstate.SeqKv | None:
        """The state of the longest cached prefix of `history` that is longer than what the
        session holds (full blocks, the last token left out), or None."""
        if not self.settings.prefix_cache or self.model.layout is None or session.imported:
            return None
        block = self.settings.block_tokens
        limit = (len(history) - 1) // block * block
        have = session.state.n_kv
        if limit <= have:
            return None
        live_n, live = self._live(session, history, limit)
        salt = session.salt.hex()
        best_n, best_store = 0, None
        for store in (self.stores.durable, self.stores.volatile):
            try:
                n = await asyncio.to_thread(store.longest_prefix, history, limit, block, salt)
            except StoreReadFailed as e:  # a remote store down: the prefix is evaluated
                log.warning("the cache of prefixes cannot be asked (%s); evaluating the prompt", e)
                continue
            if n > best_n:
                best_n, best_store = n, store
        if live is not None and live_n >= best_n and live_n > have:
            kv = await self._from_session(live, live_n)
            if kv is not None:
                return kv
        if best_store is not None and best_n > have:
            return await self._from_store(best_store, history, best_n, salt)
        return None

    def boundary_for(self, session: Session) -> int:
        """Where a generation should keep its sliding-window and recurrent sections for the
        cache: the system prompt's last block boundary, once (0: nowhere)."""
        layout = self.model.layout
        block = self.settings.block_tokens
        if not self.settings.prefix_cache or layout is None or not layout.partial:
            return 0
        if session.boundary is not None or session.system_end < block:
            return 0
        return session.system_end - session.system_end % block

    def _live(self, session: Session, history: list[int], limit: int) -> tuple[int, Session | None]:
        """The live session whose state shares the longest block-aligned prefix with history.

        Where the state has sliding windows or a recurrent part, only a source's boundary
        snapshot can be cut to: the prefix is that boundary, if history reaches it."""
        block = self.settings.block_tokens
        cut_anywhere = not self.model.layout or not self.model.layout.partial
        want = np.asarray(history[:limit], dtype=np.int64)
        best, source = 0, None
        for other in self.live():
            if other is session or other.closed or other.busy or other.imported or other.salt != session.salt:
                continue
            n = min(other.state.n_kv, limit)
            if not cut_anywhere:
                n = other.boundary[0] if other.boundary is not None and other.boundary[0] <= n else 0
            if n - n % block <= best:
                continue
            theirs = np.asarray(other.state.tokens[:n], dtype=np.int64)
            differ = np.flatnonzero(theirs != want[:n])
            common = int(differ[0]) if differ.size else n
            if not cut_anywhere and common < n:
                continue
            common -= common % block
            if common > best:
                best, source = common, other
        return best, source

    async def _from_session(self, source: Session, n: int) -> kvstate.SeqKv | None:
        """The first n positions of an idle session's state, read where it is.

        No lock is taken: the placement is read and the engine's export queued in one step,
        and the engine runs its commands in order, so a later move of the source comes after.
        The source was chosen before the stores were asked (awaits): by now it may be closed,
        or busy (in a turn, or being evicted: its state leaving the slot), and then it is no
        source (None).
        """
        if source.closed or source.busy:
            return None
        where = self.residency.where(source)
        boundary = source.boundary
        seq = self.residency.stream(source)  # its slot or dock
        if seq is not None:
            state = source.state
            kv = await asyncio.wrap_future(self.engine.call(lambda e: e.export(seq, state)))
        elif isinstance(where, Parked):
            kv = where.kv
        else:
            return None
        if kv.n < n:
            return None
        if boundary is not None and boundary[0] == n and kv.layout.partial:
            return pieces.at_boundary(kv, n, boundary[1])
        return pieces.head(kv, n)

    async def _from_store(
        self, store: CheckpointStore, history: list[int], n: int, salt: str
    ) -> kvstate.SeqKv | None:
        block = self.settings.block_tokens
        try:
            # Read into memory allocated here, on the event loop's thread (StateReads.buffer).
            into = store.reads.buffer(n)
            return await asyncio.to_thread(store.prefix_state, history, n, block, salt, into)
        except (CorruptCheckpoint, StoreReadFailed) as e:
            log.warning("a cached prefix could not be read (%s); evaluating it instead", e)
            return None
