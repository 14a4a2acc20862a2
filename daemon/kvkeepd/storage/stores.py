"""The stores a daemon keeps state in, as one value handed to the session layer, and the
one function that opens them from the settings."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvkeepd.config.settings import Settings
from kvkeepd.state import layout as kvlayout
from kvkeepd.storage.blocks import open_durable
from kvkeepd.storage.blocks.base import BlockStore
from kvkeepd.storage.blocks.local import LocalBlockStore
from kvkeepd.storage.blocks.memory import MemoryBlockStore
from kvkeepd.storage.budget import DiskBudget
from kvkeepd.storage.catalog import Catalog
from kvkeepd.storage.catalog.sqlite import SqliteCatalog
from kvkeepd.storage.checkpoints import CheckpointStore
from kvkeepd.storage.journal import FileJournal, TurnJournal
from kvkeepd.storage.statedir import StateDir
from kvkeepd.storage.storekey import key_id, store_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stores:
    """durable: persistent sessions and imports (disk); volatile: ephemeral sessions'
    checkpoints (RAM); spill: ephemeral sessions' state under memory pressure (disk, wiped
    at start); disk: the budget durable, spill and journal writes share; journal:
    persistent sessions' turns since their heads."""

    durable: CheckpointStore
    volatile: CheckpointStore
    spill: CheckpointStore
    disk: DiskBudget
    journal: TurnJournal


class StoredModel(Protocol):
    """What the stores know of the loaded model (the engine's ModelInfo is one)."""

    @property
    def layout(self) -> kvlayout.StateLayout | None:
        """Its state's layout (None: states are not stored, only histories)."""
        ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def exact(self) -> bool:
        """Whether it computes in the exact mode (a compact state is named apart)."""
        ...


def open_stores(
    settings: Settings,
    state: StateDir,
    model: StoredModel,
    fingerprint: str,
    clock: Callable[[], float] = time.time,
) -> Stores:
    """The stores of a daemon serving `model` (the file with this fingerprint), ready for
    use: durable, the catalog under the state dir (or the shared one `--catalog` names),
    blocks there too or in the remote store `--store` names, rid of blocks no checkpoint was
    committed for and swept within `--disk-budget`; volatile: both in RAM; spill: blocks
    under the state dir, wiped now, with its catalog in RAM (nothing of it outlives us); the
    turn journal (`turn_journal`). Blocking: file and network work."""
    given = store_key(state.path, text=settings.store_key, file=settings.store_key_file)
    log.info("store key %s (from %s)", given.fingerprint, given.origin)
    key = given.key

    def make(catalog: Catalog, blocks: BlockStore) -> CheckpointStore:
        return CheckpointStore(
            catalog,
            blocks,
            key,
            fingerprint=fingerprint,
            layout=model.layout,
            block_tokens=settings.block_tokens,
            codec=settings.codec,
            n_vocab=model.n_vocab,
            exact=model.exact,
        )

    catalog = durable_catalog(settings, state, key)
    blocks = open_durable(
        settings.store,
        state.path / "blocks",
        s3_endpoint=settings.s3_endpoint,
        timeout=settings.store_timeout,
        retries=settings.store_retries,
        known_bytes=catalog.block_bytes,
    )
    durable = make(catalog, blocks)
    state.wipe_spill()
    # Ephemeral sessions' catalogs stay local and in RAM whatever the durable one is.
    spill = make(SqliteCatalog(":memory:"), LocalBlockStore(state.spill))
    journal = turn_journal(catalog, state, clock)
    disk = DiskBudget(
        settings.disk_budget,
        (durable.store.total_bytes, spill.store.total_bytes, durable.catalog.file_bytes, journal.file_bytes),
        lambda target: durable.sweep(target, used=disk.used),
    )
    durable.budget = spill.budget = disk
    if isinstance(journal, FileJournal):
        journal.budget = disk
    volatile = make(SqliteCatalog(":memory:"), MemoryBlockStore())
    stores = Stores(durable=durable, volatile=volatile, spill=spill, disk=disk, journal=journal)
    try:
        orphans = durable.remove_orphans()
        if orphans:
            log.info("removed %d blocks that no checkpoint was committed for", orphans)
        durable.sweep(settings.disk_budget, disk.used)
    except BaseException:
        journal.close()
        raise
    return stores


def durable_catalog(settings: Settings, state: StateDir, key: bytes) -> Catalog:
    """sqlite in the state directory, or the shared Redis catalog `--catalog` names (redis-py
    imported only then). Daemons sharing a catalog must share the store key (storekey.py):
    one whose key differs stops here, where it would otherwise refuse every manifest."""
    if not settings.catalog:
        return SqliteCatalog(state.path / "catalog.db")
    from kvkeepd.storage.catalog.redis import RedisCatalog

    catalog = RedisCatalog(settings.catalog, grace=settings.orphan_grace)
    ours = key_id(key)
    found = catalog.store_key_id(ours)
    if found != ours:
        catalog.close()
        raise OSError(
            f"the catalog {catalog.where} holds manifests signed with another store key "
            f"(fingerprint {found[:16]}, this daemon's is {ours[:16]}): give this daemon the "
            "deployment's key (--store-key-file, KVKEEP_STORE_KEY, or store.key in its state directory)"
        )
    return catalog


def turn_journal(catalog: Catalog, state: StateDir, clock: Callable[[], float]) -> TurnJournal:
    """The turn journal: a file under the state dir, read back now (torn tail dropped), or,
    with a shared catalog, the records on its server (another daemon continues from them)."""
    if not catalog.shared:
        return FileJournal(state.path / "journal")
    from kvkeepd.storage.catalog.redis import RedisCatalog
    from kvkeepd.storage.shared_journal import SharedJournal

    assert isinstance(catalog, RedisCatalog)
    return SharedJournal(catalog, clock)
