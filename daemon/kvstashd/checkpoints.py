"""CheckpointStore: snapshots + KV cells <-> manifests and blocks in a catalog and a store.

A save writes only the blocks the store lacks (its cost grows with the new tokens), then
commits the manifest. A load checks everything before llama.cpp can see it: the manifest's
MAC and fields, the model fingerprint and KV layout, that the block keys follow from the
tokens, and each block's checksum and size. Methods block (file I/O, hashing); the
session manager runs them in worker threads.

Export format, one self-contained stream: b"KVSTEXP1", then records (u8 type, u32 length,
payload): 1 = manifest, 2 = block (64-char key + framed block), and last 0 = the
BLAKE2b-256 of every byte before that record.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from kvstashd import blocks as blk
from kvstashd import manifest as mf
from kvstashd import state as kvstate
from kvstashd.catalog import Catalog, CheckpointRow
from kvstashd.errors import CorruptCheckpoint, IncompatibleCheckpoint, InvalidRequest, NotFound
from kvstashd.manifest import Snapshot
from kvstashd.store import BlockStore

log = logging.getLogger(__name__)

_READERS = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kvstash-read")
EXPORT_MAGIC = b"KVSTEXP1"
EXPORT_CHUNK = 1 << 20
_REC = struct.Struct("<BI")
CHECKPOINT_ID_PREFIX = "c_"


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back: its snapshot and KV cells (None: evaluate the tokens again)."""

    row: CheckpointRow
    snapshot: Snapshot
    cells: kvstate.KvCells | None
    reprefill: bool


class CheckpointStore:
    """Checkpoints of one kind of session (persistent: disk; ephemeral: memory)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlockStore,
        key: bytes,
        *,
        fingerprint: str,
        layout: kvstate.KvLayout | None,
        block_tokens: int,
        codec: str,
        n_vocab: int,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.key = key
        self.fingerprint = fingerprint
        self.layout = layout
        self.layout_desc = layout.describe() if layout else None
        self.block_tokens = block_tokens
        self.codec = codec
        self.n_vocab = n_vocab
        # Saves of different sessions may run at once; each block is written once.
        self._lock = threading.Lock()

    # ---- save ----------------------------------------------------------------------------

    def save(
        self,
        snap: Snapshot,
        cells: kvstate.KvCells | None,
        *,
        kind: str,
        now: float,
        head_of: str | None = None,
        foreign_layout: str | None = None,
    ) -> tuple[CheckpointRow, Snapshot]:
        """Write the snapshot's missing blocks, then commit its manifest. Returns the row
        and the snapshot as stored (with its block keys)."""
        n_kv = cells.n if cells is not None else 0
        keys = self._chain(snap.tokens[:n_kv], snap.block_tokens) if n_kv else []
        written = referenced = 0
        sizes: list[tuple[str, int]] = []
        with self._lock:
            for i, key in enumerate(keys):
                size = self.catalog.block_size(key)
                if size is None or not self.store.has(key):
                    assert cells is not None
                    p0 = i * snap.block_tokens
                    data = blk.frame(kvstate.cut(cells, p0, min(p0 + snap.block_tokens, n_kv)), self.codec)
                    written += self.store.put(key, data)
                    size = len(data)
                sizes.append((key, size))
                referenced += size
            snap = replace(
                snap,
                n_kv=n_kv,
                blocks=keys,
                kv_layout=self.layout_desc if n_kv else foreign_layout,
                saved_at=now,
                fingerprint=self.fingerprint,
            )
            data = mf.encode(snap, self.key)
            row = CheckpointRow(
                checkpoint_id=CHECKPOINT_ID_PREFIX + secrets.token_hex(12),
                session_id=snap.session_id,
                label=snap.label,
                kind=kind,
                n_tokens=len(snap.tokens),
                bytes_written=written + len(data),
                bytes_referenced=referenced + len(data),
                created_at=now,
            )
            self.catalog.add_checkpoint(row, data, sizes, now, head_of=head_of)
        return row, snap

    def _chain(self, tokens: list[int], block_tokens: int) -> list[str]:
        return blk.chain(
            tokens,
            fingerprint=self.fingerprint,
            layout=self.layout_desc or "",
            block_tokens=block_tokens,
            salt=b"",
        )

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

    def cells(self, snap: Snapshot) -> tuple[kvstate.KvCells | None, bool]:
        """The KV cells of a checked snapshot from this store: (cells, must re-prefill)."""
        return self._cells(snap, self.store.get)

    def load(self, checkpoint_id: str, now: float) -> Loaded:
        row, data = self.row(checkpoint_id)
        snap = mf.decode(data, self.key, self.n_vocab)
        cells, reprefill = self._cells(snap, self.store.get)
        if snap.blocks:
            self.catalog.touch(snap.blocks, now)
        return Loaded(row, snap, cells, reprefill)

    def _cells(self, snap: Snapshot, read: Callable[[str], bytes]) -> tuple[kvstate.KvCells | None, bool]:
        """Check the snapshot fits this daemon; read its blocks. (cells, must re-prefill)."""
        if snap.fingerprint != self.fingerprint:
            raise IncompatibleCheckpoint(
                f"the checkpoint was made with another model ({snap.fingerprint[:12]}, "
                f"this daemon runs {self.fingerprint[:12]})"
            )
        if snap.kv_layout is None:
            return None, False
        if snap.kv_layout != self.layout_desc:
            theirs = snap.kv_layout.split(";", 1)
            ours = (self.layout_desc or "").split(";", 1)
            if len(theirs) == 2 and len(ours) == 2 and theirs[1] == ours[1]:
                log.warning(
                    "checkpoint KV state version %s is not %s: re-evaluating its tokens",
                    theirs[0],
                    ours[0],
                )
                return None, True
            raise IncompatibleCheckpoint(
                f"the checkpoint's KV layout ({snap.kv_layout}) differs from this daemon's "
                f"({self.layout_desc}): another --kv-type or engine mode"
            )
        if snap.n_kv == 0:
            return None, False
        assert self.layout is not None
        if self._chain(snap.tokens[: snap.n_kv], snap.block_tokens) != snap.blocks:
            raise CorruptCheckpoint("the checkpoint's block keys do not follow from its tokens")
        counts = _counts(snap.n_kv, snap.block_tokens)
        cell_bytes = self.layout.cell_bytes
        # File reads and CRC-32 release the GIL: blocks are read and checked on every core.
        payloads = list(
            _READERS.map(
                lambda kc: self._block(kc[0], kc[1] * cell_bytes, read)[1],
                zip(snap.blocks, counts, strict=True),
            )
        )
        return kvstate.join(self.layout, payloads, counts), False

    def _block(self, key: str, size: int, read: Callable[[str], bytes]) -> tuple[bytes, bytes | memoryview]:
        """One block, read once and checked: (its frame, its payload). A damaged block of
        this store is removed, so that the next checkpoint holding those tokens writes it
        again instead of reusing it."""
        try:
            data = read(key)
        except KeyError:
            raise CorruptCheckpoint(f"a KV block of the checkpoint is missing ({key[:12]})") from None
        try:
            return data, blk.unframe(data, size)
        except CorruptCheckpoint:
            if read == self.store.get:
                log.error("removing damaged block %s", key)
                with self._lock:
                    self.store.delete(key)
            raise

    # ---- delete and sweep -------------------------------------------------------------------

    def delete(self, checkpoint_id: str) -> None:
        if not self.catalog.delete(checkpoint_id):
            raise NotFound(f"no checkpoint {checkpoint_id}")

    def sweep(self, budget_bytes: int) -> int:
        """Drop unreferenced blocks, least recently used first, until the store fits the
        budget. Returns the bytes freed."""
        freed = 0
        with self._lock:
            dropped = []
            for key, size in self.catalog.unreferenced():
                if self.store.total_bytes() <= budget_bytes:
                    break
                self.store.delete(key)
                dropped.append(key)
                freed += size
            self.catalog.forget_blocks(dropped)
        return freed

    def remove_orphans(self) -> int:
        """Delete block files no catalog row knows: what a crash left between writing a
        block and committing its manifest. Run at start, before any save."""
        with self._lock:
            known = self.catalog.known_blocks()
            orphans = [key for key in self.store.block_keys() if key not in known]
            for key in orphans:
                self.store.delete(key)
        return len(orphans)

    # ---- export and import -------------------------------------------------------------------

    def export(self, checkpoint_id: str) -> Iterator[bytes]:
        """The checkpoint as a self-contained stream of chunks of at most 1 MiB."""
        _, data = self.row(checkpoint_id)
        snap = mf.decode(data, self.key, self.n_vocab)
        digest = hashlib.blake2b(digest_size=32)
        out = io.BytesIO()

        def emit(b: bytes) -> Iterator[bytes]:
            digest.update(b)
            out.write(b)
            while out.tell() >= EXPORT_CHUNK:
                buf = out.getvalue()
                yield buf[:EXPORT_CHUNK]
                out.seek(0)
                out.truncate()
                out.write(buf[EXPORT_CHUNK:])

        yield from emit(EXPORT_MAGIC)
        yield from emit(_REC.pack(1, len(data)) + data)
        cell_bytes = self.layout.cell_bytes if self.layout else 0
        for key, count in zip(snap.blocks, _counts(snap.n_kv, snap.block_tokens), strict=True):
            block, _ = self._block(key, count * cell_bytes, self.store.get)  # never ship damage
            yield from emit(_REC.pack(2, 64 + len(block)) + key.encode() + block)
        final = out.getvalue() + _REC.pack(0, 32) + digest.digest()
        for at in range(0, len(final), EXPORT_CHUNK):
            yield final[at : at + EXPORT_CHUNK]

    def import_(self, chunks: Iterable[bytes], limit: int, now: float) -> CheckpointRow:
        """Check an exported stream completely, then store it as an imported checkpoint."""
        buf = bytearray()
        for c in chunks:
            buf += c
            if len(buf) > limit:
                raise InvalidRequest(f"the import exceeds {limit} bytes")
        data = bytes(buf)
        if not data.startswith(EXPORT_MAGIC):
            raise CorruptCheckpoint("the data is not a kvstash checkpoint export")
        at = len(EXPORT_MAGIC)
        manifest: bytes | None = None
        found: dict[str, bytes] = {}
        while True:
            if at + _REC.size > len(data):
                raise CorruptCheckpoint("the checkpoint export is truncated")
            kind, length = _REC.unpack_from(data, at)
            start = at + _REC.size
            body = data[start : start + length]
            if len(body) != length:
                raise CorruptCheckpoint("the checkpoint export is truncated")
            if kind == 0:
                if length != 32 or hashlib.blake2b(data[:at], digest_size=32).digest() != body:
                    raise CorruptCheckpoint("the checkpoint export fails its checksum")
                if start + length != len(data):
                    raise CorruptCheckpoint("the checkpoint export has trailing bytes")
                break
            if kind == 1 and manifest is None:
                manifest = body
            elif kind == 2 and length > 64:
                found[body[:64].decode("ascii", "replace")] = body[64:]
            else:
                raise CorruptCheckpoint("the checkpoint export has an unexpected record")
            at = start + length
        if manifest is None:
            raise CorruptCheckpoint("the checkpoint export has no manifest")
        # The exporting daemon's key is not ours: check structure and content instead.
        snap = mf.decode(manifest, None, self.n_vocab)
        if set(found) != set(snap.blocks):
            raise CorruptCheckpoint("the checkpoint export's blocks do not match its manifest")
        cells, reprefill = self._cells(snap, found.__getitem__)
        snap = replace(snap, session_id="", persistent=True)
        # KV of another llama.cpp state version is not kept; its layout is, so that a
        # restore says it re-evaluates the tokens.
        foreign = snap.kv_layout if reprefill else None
        return self.save(snap, cells, kind="imported", now=now, foreign_layout=foreign)[0]


def _counts(n: int, block_tokens: int) -> list[int]:
    return [min(block_tokens, n - p) for p in range(0, n, block_tokens)]
