"""The export format: one self-contained stream of a checkpoint, and its import.

b"KVKPEXP1", then records (u8 type, u32 length, payload): 1 = the manifest, 2 = a block or
piece (its 64-character key, then its frame), and last 0 = the BLAKE2b-256 of every byte
before that record. An import is untrusted input: it is checked whole (digest, manifest
fields, keys, every block) before anything is stored, and stored under a salt of its own.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import struct
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, BinaryIO

from kvkeepd.errors import CorruptCheckpoint, InvalidRequest
from kvkeepd.state import manifest as mf
from kvkeepd.storage.catalog import CheckpointRow

if TYPE_CHECKING:
    from kvkeepd.storage.checkpoints import CheckpointStore

EXPORT_MAGIC = b"KVKPEXP1"
EXPORT_CHUNK = 1 << 20
_REC = struct.Struct("<BI")
# A manifest holds tokens, logits and messages: at most 4 bytes a token, 4 a logit and the
# messages' text, within the RPC limits (manifest.check_limits).
MAX_MANIFEST_BYTES = 256 << 20
# More pieces than any state of a context of 2**20 tokens has.
MAX_IMPORT_PIECES = 1 << 16


def export(store: CheckpointStore, checkpoint_id: str) -> Iterator[bytes]:
    """The checkpoint as a self-contained stream of chunks of at most 1 MiB."""
    _, data = store.row(checkpoint_id)
    snap = mf.decode(data, store.key, store.n_vocab)
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
    if snap.kv_layout == store.layout_desc:
        full, window, rec = store.plan(snap.tokens, snap.n_kv, snap.block_tokens, snap.salt)
        for piece in [*full, *window, *([rec] if rec else [])]:
            block, _ = store.reads.block(piece.key, piece.size, store.store.get)  # never ship damage
            yield from emit(_REC.pack(2, 64 + len(block)) + piece.key.encode() + block)
    final = out.getvalue() + _REC.pack(0, 32) + digest.digest()
    for at in range(0, len(final), EXPORT_CHUNK):
        yield final[at : at + EXPORT_CHUNK]


def import_chunks(
    store: CheckpointStore, chunks: Iterable[bytes], limit: int, now: float, *, tenant: str, n_ctx: int
) -> CheckpointRow:
    """Import an exported stream given as chunks (spooled to a temporary file first):
    see import_file. InvalidRequest beyond `limit` bytes."""
    with tempfile.TemporaryFile() as spool:
        size = 0
        for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise InvalidRequest(f"the import exceeds {limit} bytes")
            spool.write(chunk)
        spool.flush()
        return import_file(store, spool, now, tenant=tenant, n_ctx=n_ctx)


def import_file(
    store: CheckpointStore, spool: BinaryIO, now: float, *, tenant: str, n_ctx: int
) -> CheckpointRow:
    """Check an exported stream (in a file) completely, then store it as an imported
    checkpoint of `tenant`. The file is read in pieces: what this holds in memory is the
    manifest and one state, never the whole stream.

    Its pieces are stored under a salt of their own: bytes from elsewhere never stand
    for blocks this daemon computed, even when their tokens are the same. Every field of
    its manifest is held to the RPCs' limits (`n_ctx`: this daemon's context).
    """
    fd = spool.fileno()
    digest = hashlib.blake2b(digest_size=32)
    at = 0

    def take(n: int, hashed: bool = True) -> bytes:
        nonlocal at
        data = os.pread(fd, n, at)
        if len(data) != n:
            raise CorruptCheckpoint("the checkpoint export is truncated")
        if hashed:
            digest.update(data)
        at += n
        return data

    if os.pread(fd, len(EXPORT_MAGIC), 0) != EXPORT_MAGIC:
        raise CorruptCheckpoint("the data is not a kvkeep checkpoint export")
    take(len(EXPORT_MAGIC))
    manifest: bytes | None = None
    found: dict[str, tuple[int, int]] = {}
    while True:
        header = take(_REC.size, hashed=False)
        kind, length = _REC.unpack(header)
        if kind == 0:
            if length != 32 or take(32, hashed=False) != digest.digest():
                raise CorruptCheckpoint("the checkpoint export fails its checksum")
            if os.pread(fd, 1, at):
                raise CorruptCheckpoint("the checkpoint export has trailing bytes")
            break
        digest.update(header)
        if kind == 1 and manifest is None and length <= MAX_MANIFEST_BYTES:
            manifest = take(length)
        elif kind == 2 and length > 64 and len(found) < MAX_IMPORT_PIECES:
            key = take(64).decode("ascii", "replace")
            found[key] = (at, length - 64)
            left = length - 64
            while left:  # hashed in pieces, kept in the file
                left -= len(take(min(left, EXPORT_CHUNK)))
        else:
            raise CorruptCheckpoint("the checkpoint export has an unexpected record")
    if manifest is None:
        raise CorruptCheckpoint("the checkpoint export has no manifest")
    # The exporting daemon's key is not ours: check structure and content instead.
    snap = mf.decode(manifest, None, store.n_vocab)
    mf.check_limits(snap, n_ctx)
    if snap.kv_layout == store.layout_desc and set(found) != set(snap.piece_keys()):
        raise CorruptCheckpoint("the checkpoint export's blocks do not match its manifest")

    def read(key: str) -> bytes:
        offset, n = found[key]
        return os.pread(fd, n, offset)  # thread-safe: pieces are read in parallel

    kv, reprefill = store.checked_cells(snap, read)
    snap = replace(
        snap, session_id="", persistent=True, salt=secrets.token_hex(16), imported=True, tenant=tenant
    )
    # The state of another layout is not kept; its layout is, so that a restore says it
    # evaluates the tokens again.
    foreign = snap.kv_layout if reprefill else None
    return store.save(snap, kv, kind="imported", now=now, foreign_layout=foreign)[0]
