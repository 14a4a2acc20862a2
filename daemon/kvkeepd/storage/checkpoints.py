"""CheckpointStore: snapshots + KV cells <-> manifests and blocks in a catalog and a store.

A save writes only the blocks the store lacks (its cost grows with the new tokens), then
commits the manifest. A load checks everything before llama.cpp can see it: the manifest's
MAC and fields, the model fingerprint and KV layout, that the block keys follow from the
tokens, and each block's checksum and size. Methods block (file I/O, hashing); the
session manager runs them in worker threads.
Reading blocks back into a state is storage/state_reads.py's; exports and imports are
storage/exports.py's: a client of this store.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from kvkeepd.errors import (
    Busy,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    KvkeepError,
    NotFound,
    StoreReadFailed,
    StoreUnreachable,
)
from kvkeepd.state import cells as kvstate
from kvkeepd.state import frames as blk
from kvkeepd.state import layout as kvlayout
from kvkeepd.state import manifest as mf
from kvkeepd.state.manifest import Snapshot
from kvkeepd.state.plan import Piece, Plan, payloads, plan
from kvkeepd.storage.blocks.base import BlockStore
from kvkeepd.storage.blocks.puts import put_framed
from kvkeepd.storage.budget import DiskBudget
from kvkeepd.storage.catalog import Catalog, CheckpointRow
from kvkeepd.storage.collector import claim_blocks, delete_decided
from kvkeepd.storage.state_reads import Blob, StateReads

log = logging.getLogger(__name__)


CHECKPOINT_ID_PREFIX = "c_"


def new_checkpoint_id() -> str:
    return CHECKPOINT_ID_PREFIX + secrets.token_hex(12)


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back: its snapshot and state (None: evaluate the tokens again)."""

    row: CheckpointRow
    snapshot: Snapshot
    kv: kvstate.SeqKv | None
    reprefill: bool


class CheckpointStore:
    """Checkpoints of one kind of session (persistent: disk; ephemeral: memory).

    A state is stored as pieces, each a block of the store: the full-attention KV cut into
    blocks of `block_tokens` positions (keys: the hash chain over the tokens), the
    sliding-window KV of the window cut on the same grid (keys derived from the chain key of
    the block a piece lies in, and the piece's first position in it), and the recurrent
    state (key derived from the last chain key). Equal tokens give equal keys, so sessions
    with a common prefix share its blocks.
    """

    def __init__(
        self,
        catalog: Catalog,
        store: BlockStore,
        key: bytes,
        *,
        fingerprint: str,
        layout: kvlayout.StateLayout | None,
        block_tokens: int,
        codec: str,
        n_vocab: int,
        exact: bool = True,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.key = key
        self.fingerprint = fingerprint
        self.layout = layout
        # NOTE: states computed in compact mode are named apart from exact ones (same bytes'
        # layout, other values), so blocks of one never stand for the other's: an exact
        # daemon evaluates a compact checkpoint's tokens again, and the reverse.
        self.layout_desc = (layout.describe() + ("" if exact else ";compact")) if layout else None
        self.block_tokens = block_tokens
        self.codec = codec
        self.n_vocab = n_vocab
        # The disk budget this store's writes count against (none: a store in RAM).
        self.budget: DiskBudget | None = None
        # A tenant's stored-bytes quota by its name, 0 for none (none: a store nobody's
        # quota counts, as ephemeral sessions' stores are).
        self.quota: Callable[[str], int] | None = None
        # Saves of different sessions may run at once; each block is written once.
        self._lock = threading.Lock()
        self.reads = StateReads(store, layout, self._lock)

    # ---- save ----------------------------------------------------------------------------

    def save(
        self,
        snap: Snapshot,
        kv: kvstate.SeqKv | None,
        *,
        kind: str,
        now: float,
        head_of: str | None = None,
        fence: int = 0,
        foreign_layout: str | None = None,
        boundary: tuple[int, tuple[kvstate.Section, ...]] | None = None,
        checkpoint_id: str = "",
        response: bytes | None = None,
    ) -> tuple[CheckpointRow, Snapshot]:
        """Write the snapshot's missing pieces, then commit its manifest. Returns the row
        and the snapshot as stored (with its piece keys).

        `boundary`: sliding-window and recurrent sections at an earlier block boundary of the
        same history (the system prompt's), stored and referenced too, so that the prefix
        cache finds the whole state there (see prefix.py). `fence`: the lease token a head
        write is conditioned on (Catalog.add_checkpoint). `checkpoint_id`: the id to commit
        it under (a new one if empty); `response`: a stored response's record, committed
        with it."""
        n_kv = kv.n if kv is not None else 0
        full, window, rec = self.plan(snap.tokens, n_kv, snap.block_tokens, snap.salt)
        extra: list[tuple[Piece, Callable[[], bytes]]] = []
        if boundary is not None and kv is not None and 0 < boundary[0] <= len(snap.tokens):
            at, partial = boundary
            _, window_at, rec_at = self.plan(snap.tokens, at, snap.block_tokens, snap.salt)
            boundary_kv = kvstate.SeqKv(kv.layout, at, partial)
            extra = list(payloads(boundary_kv, [], window_at, rec_at))
        unique: dict[str, tuple[Piece, Callable[[], bytes]]] = {}
        for piece, payload in [*payloads(kv, full, window, rec), *extra]:
            unique.setdefault(piece.key, (piece, payload))
        snap = replace(
            snap,
            n_kv=n_kv,
            blocks=[p.key for p in full],
            window=[(p.key, p.start) for p in window],
            recurrent=rec.key if rec else "",
            kv_layout=self.layout_desc if n_kv else foreign_layout,
            saved_at=now,
            fingerprint=self.fingerprint,
        )
        data = mf.encode(snap, self.key)
        # At most: the pieces the store lacks, raw and framed, and the manifest (twice: the
        # catalog's write-ahead log holds it until its next checkpoint).
        # One batch per question: a remote store answers in a round trip, not one per piece.
        held = self._held(list(unique))
        lacking = [p for p, _ in unique.values() if p.key not in held]
        bound = sum(p.size + blk.FRAME_HEADER for p in lacking) + 2 * len(data) + 4096
        most = [(p.key, p.size + blk.FRAME_HEADER) for p, _ in unique.values()]
        own = len(data) + len(response or b"")
        with (
            self._quota_room(snap.tenant, most, own) as reservation,
            self.budget.reserve(bound) if self.budget else contextlib.nullcontext(),
            self._lock,
        ):
            written: dict[str, tuple[int, int]] = {}
            try:
                # Claimed, then asked again under the lock: a sweep (or, with a shared store,
                # another daemon's collector) may have dropped blocks meanwhile, and a claim
                # keeps them from dropping those this save relies on.
                claim = claim_blocks(self.catalog, list(unique))
                held = self._held(list(unique))
                put_framed(
                    self.store,
                    self.codec,
                    [(p, f) for p, f in unique.values() if p.key not in claim.sizes or p.key not in held],
                    written,
                )
                sizes = [(key, written[key][0] if key in written else claim.sizes[key]) for key in unique]
                row = CheckpointRow(
                    checkpoint_id=checkpoint_id or new_checkpoint_id(),
                    session_id=snap.session_id,
                    label=snap.label,
                    kind=kind,
                    n_tokens=len(snap.tokens),
                    bytes_written=sum(n for _, n in written.values()) + len(data),
                    bytes_referenced=sum(size for _, size in sizes) + len(data),
                    created_at=now,
                    tenant=snap.tenant,
                )
                self.catalog.add_checkpoint(
                    row,
                    data,
                    sizes,
                    now,
                    head_of=head_of,
                    fence=fence,
                    claimed_at=claim.at,
                    response=response,
                    reservation=reservation,
                )
            except BaseException:
                # Blocks this save wrote that no committed checkpoint knows: reclaimed now (best
                # effort) on a store of this daemon's alone; a shared one's collector takes them
                # after its grace period (another daemon's save may rely on them meanwhile).
                new_keys = [key for key, (_, n) in written.items() if n]
                if new_keys and not self.catalog.shared:
                    with contextlib.suppress(OSError, KvkeepError):
                        known = self.catalog.present(new_keys)
                        for key in new_keys:
                            if key not in known:
                                self.store.delete(key)
                raise
        return row, snap

    @contextlib.contextmanager
    def _quota_room(self, tenant: str, blocks: Sequence[tuple[str, int]], own: int) -> Iterator[str]:
        """Room under the tenant's stored-bytes quota for a save that may add `blocks` (key,
        most bytes) and `own` bytes (manifest and record), held before it writes anything:
        its reservation's id ("" with no quota), or Busy. A save that commits turns it into
        what it stored (add_checkpoint); one that fails lets it go."""
        limit = self.quota(tenant) if self.quota is not None else 0
        if not limit:
            yield ""
            return
        room = self.catalog.reserve_stored(tenant, blocks, own, limit)
        if not room.reservation_id:
            raise Busy(
                f"the tenant's stored state holds {room.held} bytes (with saves under way) and this save "
                f"may add {room.needed}, past its quota of {limit}: delete checkpoints or stored "
                "responses, or close persistent sessions; nothing was saved"
            )
        try:
            yield room.reservation_id
        except BaseException:
            # Best effort: a reservation left behind lapses with the claims' grace period.
            with contextlib.suppress(OSError, KvkeepError):
                self.catalog.release_stored(tenant, room.reservation_id)
            raise

    def _held(self, keys: list[str]) -> set[str]:
        """Which pieces of a save the store holds. A remote store that cannot say fails the
        save as a write it did not take (StoreUnreachable), as a failed put would."""
        try:
            return self.store.present(keys)
        except StoreReadFailed:
            if not self.store.remote:
                raise
            raise StoreUnreachable(
                "the block store does not answer (see the daemon's log); nothing was saved"
            ) from None

    def plan(self, tokens: list[int], n: int, block_tokens: int, salt: str) -> Plan:
        """The pieces that hold the state after tokens[:n] in this store (see plan.plan)."""
        if self.layout is None:
            return [], [], None
        return plan(self.layout, self.fingerprint, self.layout_desc or "", tokens, n, block_tokens, salt)

    # ---- load ----------------------------------------------------------------------------

    def row(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes]:
        found = self.catalog.get(checkpoint_id)
        if found is None:
            raise NotFound(f"no checkpoint {checkpoint_id}")
        return found

    def snapshot(self, checkpoint_id: str) -> Snapshot:
        """A checkpoint's manifest, checked, without reading its blocks."""
        _, data = self.row(checkpoint_id)
        return mf.decode(data, self.key, self.n_vocab)

    def cells(self, snap: Snapshot, into: Blob | None = None) -> tuple[kvstate.SeqKv | None, bool]:
        """The state of a checked snapshot from this store: (state, must re-prefill);
        `into`: the buffer `read_buffer(snap)` gave for it."""
        return self.checked_cells(snap, self.store.get, into)

    def read_buffer(self, snap: Snapshot) -> Blob | None:
        """Memory for the snapshot's state where this store reads it in place (None
        elsewhere), for the thread that will also free it to allocate (StateReads.buffer)."""
        if not snap.n_kv or snap.kv_layout != self.layout_desc:
            return None
        return self.reads.buffer(snap.n_kv)

    @property
    def reads_in_place(self) -> bool:
        """Whether states are read from this store straight into the blob llama.cpp takes."""
        return self.reads.in_place

    def load(
        self,
        checkpoint_id: str,
        now: float,
        snap: Snapshot | None = None,
        whole: kvstate.SeqKv | None = None,
        into: Blob | None = None,
    ) -> Loaded:
        """A checkpoint's manifest and state, read and checked; `snap`: its manifest, if
        `snapshot` gave it already (checkpoints are immutable: it is not decoded again);
        `whole`: its state as this daemon saved it (sessions/whole_states.py): its blocks are not
        read; `into`: the buffer `read_buffer` gave for it."""
        row, data = self.row(checkpoint_id)
        snap = snap or mf.decode(data, self.key, self.n_vocab)
        kv: kvstate.SeqKv | None = whole
        reprefill = False
        if whole is None or whole.n != snap.n_kv or snap.kv_layout != self.layout_desc:
            kv, reprefill = self.checked_cells(snap, self.store.get, into)
        keys = snap.piece_keys()
        if keys:
            self.catalog.touch(keys, now)
        return Loaded(row, snap, kv, reprefill)

    def checked_cells(
        self, snap: Snapshot, read: Callable[[str], bytes], into: Blob | None = None
    ) -> tuple[kvstate.SeqKv | None, bool]:
        """Check the snapshot fits this daemon; read its pieces. (state, must re-prefill)."""
        if snap.fingerprint != self.fingerprint:
            raise IncompatibleCheckpoint(
                f"the checkpoint was made with another model ({snap.fingerprint[:12]}, "
                f"this daemon runs {self.fingerprint[:12]})"
            )
        if snap.kv_layout is None:
            return None, False
        if snap.kv_layout != self.layout_desc:
            # Another --kv-type, engine mode or llama.cpp state version: the tokens are good.
            log.warning(
                "checkpoint state layout %s is not this daemon's %s: re-evaluating its tokens",
                snap.kv_layout[:60],
                (self.layout_desc or "none")[:60],
            )
            return None, True
        if snap.n_kv == 0:
            return None, False
        lay = self.layout
        assert lay is not None
        full, window, rec = self.plan(snap.tokens, snap.n_kv, snap.block_tokens, snap.salt)
        if (
            [p.key for p in full] != snap.blocks
            or [(p.key, p.start) for p in window] != snap.window
            or (rec.key if rec else "") != snap.recurrent
        ):
            raise CorruptCheckpoint("the checkpoint's block keys do not follow from its tokens")
        return self.reads.state(snap.n_kv, full, window, rec, read, into), False

    # ---- the prefix cache --------------------------------------------------------------------

    def longest_prefix(self, tokens: list[int], limit: int, block_tokens: int, salt: str) -> int:
        """The longest n <= limit, a multiple of block_tokens, whose state this store holds
        every piece of (its keys follow from tokens[:n] and the salt); 0 if none."""
        if self.layout is None or limit < block_tokens:
            return 0
        limit -= limit % block_tokens
        full, window, rec = self.plan(tokens, limit, block_tokens, salt)
        present = self.catalog.present([p.key for p in full])
        known = [p.key for p in full if p.key in present]
        held = self.store.present(known) if known else set()
        n = 0 if full else limit  # a recurrent model has no full-attention blocks
        for p in full:
            if p.key not in held:
                break
            n = p.end
        if self.layout.windowed is None and self.layout.recurrent is None:
            return n
        while n >= block_tokens:  # window pieces and the recurrent state exist at few points
            _, window, rec = self.plan(tokens, n, block_tokens, salt)
            extra = [p.key for p in [*window, *([rec] if rec else [])]]
            have = self.catalog.present(extra)
            if all(k in have for k in extra) and len(self.store.present(extra)) == len(set(extra)):
                return n
            n -= block_tokens
        return 0

    def prefix_state(
        self, tokens: list[int], n: int, block_tokens: int, salt: str, into: Blob | None = None
    ) -> kvstate.SeqKv:
        """The state after tokens[:n] from this store's pieces (see longest_prefix); `into`:
        the buffer `reads.buffer(n)` gave for it."""
        full, window, rec = self.plan(tokens, n, block_tokens, salt)
        return self.reads.state(n, full, window, rec, self.store.get, into)

    # ---- delete and sweep -------------------------------------------------------------------

    def delete(self, checkpoint_id: str) -> None:
        if not self.catalog.delete(checkpoint_id):
            raise NotFound(f"no checkpoint {checkpoint_id}")

    def delete_with_blocks(self, checkpoint_id: str) -> int:
        """Delete a checkpoint and the blocks that only it referenced (not left for the
        sweeper: what is deleted goes now). Returns the blocks deleted; NotFound if there was
        no such checkpoint."""
        snap = self.snapshot(checkpoint_id)
        self.delete(checkpoint_id)
        with self._lock:
            gone = self.catalog.forget_blocks(snap.piece_keys())
            for key in gone:
                self.store.delete(key)
        return len(gone)

    def sweep(self, budget_bytes: int, used: Callable[[], int] | None = None) -> int:
        """Drop unreferenced blocks, least recently used first, until the store (or what
        `used` counts) fits the budget. Returns the bytes freed."""
        used = used or self.store.total_bytes
        freed = 0
        if used() <= budget_bytes:  # within it: the (shared, maybe remote) catalog is not listed
            return 0
        with self._lock:
            for key, size in self.catalog.unreferenced():
                if used() <= budget_bytes:
                    break
                # Forgotten first, and only if still unreferenced and unclaimed: with a
                # shared catalog, another daemon may have referenced or claimed it since the
                # list was read (and a remote store's bytes are what the catalog records).
                decided = time.monotonic()
                if self.catalog.forget_blocks([key]):
                    freed += size * delete_decided(self.store, self.catalog, [key], decided)
        return freed

    def remove_orphans(self) -> int:
        """Delete block files no catalog row knows: what a crash left between writing a
        block and committing its manifest. Run at start, before any save."""
        if self.store.remote:
            # Listing a bucket or a keyspace is as slow as the store is big, and another
            # daemon's blocks may be there: a remote store is never listed at start.
            return 0
        with self._lock:
            known = self.catalog.known_blocks()
            orphans = [key for key in self.store.block_keys() if key not in known]
            for key in orphans:
                self.store.delete(key)
        return len(orphans)
