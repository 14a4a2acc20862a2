"""Orphaned blocks of a shared store, reclaimed while other daemons write.

A save puts its blocks, then commits its checkpoint; one cut short (a `kill -9`, a lost
server, a failed commit) leaves blocks that no committed checkpoint knows. A store of one
daemon's is swept at its start (CheckpointStore.remove_orphans); a shared one is written by
other daemons meanwhile, and a block of theirs looks the same as an orphan until its save
commits. So the catalog decides, by claims (the scripts in catalog/redis_scripts.py):

- Before a save writes or relies on a block, it claims it (`claim_blocks`: one script for
  all its blocks, stamped with the catalog server's clock), and it must commit within the
  grace period (`--orphan-grace`) of that claim: the commit of a later one is refused, and
  the save fails (StaleClaim).
- The collector, one daemon of the cluster at a time (the `collector` duty, leases.py),
  takes the claims older than the grace period whose blocks no committed checkpoint knows:
  those are what saves cut short left, since each save has committed or failed by then.
  They are marked deleting in the same script, deleted from the store, then unmarked.
- A claim made while its block is marked deleting waits until the deletion is over (and
  then writes the block again); a block claimed within the grace period is neither
  collected nor forgotten by a budget sweep. So no block that a committed checkpoint
  references, or that a save in time will commit, is ever deleted.

A deleter that stalls between deciding and deleting (a paused process) could delete a block
a save then relied on: so a deletion is given up once `GIVE_UP` seconds have passed since
it was decided (the block is claimed again later and collected by a later pass), and a
deleting mark older than the catalog's DELETING_STALE (longer) no longer holds claims off.

The collector never lists the store: a listing costs as much as the store is big, and it
would show blocks of other deployments sharing a bucket as orphans of this one. What it
reclaims is exactly what saves of this deployment claimed and did not commit.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

from kvkeepd.errors import KvkeepError, StoreUnreachable
from kvkeepd.storage.blocks.base import BlockStore
from kvkeepd.storage.catalog import Catalog, Claim

log = logging.getLogger(__name__)

#: How long a claim waits for its blocks' deletion to end, then fails the save.
CLAIM_WAIT = 10.0
#: Seconds after deciding to delete blocks past which their deleter gives up deleting.
GIVE_UP = 20.0
#: Blocks one collector pass takes at most (several scripts of BATCH).
PER_PASS = 10_000
BATCH = 500


def claim_blocks(catalog: Catalog, keys: Sequence[str]) -> Claim:
    """The save's claim on its blocks, once none of them is being deleted (StoreUnreachable
    if some still are after CLAIM_WAIT seconds)."""
    deadline = time.monotonic() + CLAIM_WAIT
    while True:
        claim = catalog.claim_blocks(keys)
        if not claim.busy:
            return claim
        if time.monotonic() > deadline:
            raise StoreUnreachable("blocks of this state are being deleted from the store; try again")
        time.sleep(0.05)


def delete_decided(store: BlockStore, catalog: Catalog, keys: Sequence[str], decided: float) -> int:
    """Delete from the store the blocks the catalog marked deleting at `decided`
    (time.monotonic), unless GIVE_UP seconds have passed since; clear their marks either
    way. Returns how many were deleted."""
    deleted = 0
    try:
        for key in keys:
            if time.monotonic() - decided > GIVE_UP:
                log.warning(
                    "%d blocks were not deleted (too slow): a later pass takes them", len(keys) - deleted
                )
                break
            store.delete(key)
            deleted += 1
    finally:
        with contextlib.suppress(KvkeepError):
            catalog.deleted_blocks(list(keys))
            if deleted < len(keys):  # claimed again: collected once the grace period is over
                catalog.claim_blocks(list(keys[deleted:]))
    return deleted


def collect(store: BlockStore, catalog: Catalog) -> int:
    """One pass of the collector: the blocks saves claimed more than the grace period ago
    that no committed checkpoint knows, deleted. Returns how many."""
    deleted = 0
    while deleted < PER_PASS:
        decided = time.monotonic()
        doomed = catalog.doomed_blocks(BATCH)
        if not doomed:
            break
        deleted += delete_decided(store, catalog, doomed, decided)
        if len(doomed) < BATCH:
            break
    if deleted:
        log.info("collected %d orphaned blocks (written by saves that did not commit)", deleted)
    return deleted
