"""Session KV state <-> bytes: llama.cpp's sequence-state blob, parsed, cut into blocks,
validated and reassembled.

`llama_state_seq_get_data(seq)` of the pinned llama.cpp writes, for a plain KV cache:

    u32 magic (0xaf143cd8)  i32 source seq id  u32 n_stream
    per stream: u32 cell_count, and when it is not 0:
        per cell: i32 pos, u32 n_seq_id (1), i32 seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K
        per layer, v_trans=0: i32 v_type, u64 v_row_bytes, cell_count rows of V
        per layer, v_trans=1: i32 v_type, u32 v_elem_bytes, u32 n_embd_v,
                              n_embd_v rows of cell_count elements (V transposed)

Cells are written in cell-index order, which after a rewind need not be position order.
`parse` accounts for every byte, sorts the cells by position, and requires positions to be
exactly 0..n-1; llama.cpp itself accepts negative, duplicate and huge positions silently.
A *block* is the slice of cells [p0, p1) of every layer, in this context's native layout;
`assemble` joins blocks back into one blob for a target slot. Nothing here calls llama.cpp.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstashd.errors import CorruptCheckpoint

SEQ_MAGIC = 0xAF143CD8
# Bumped when the layout above changes with a llama.cpp upgrade; checkpoints made under
# another state version restore by re-evaluating their tokens.
STATE_VERSION = "llama.cpp-seq-state-1"

Bytes = npt.NDArray[np.uint8]


class StateFormatError(CorruptCheckpoint):
    """A sequence-state blob that does not match the expected structure."""


@dataclass(frozen=True)
class KvLayout:
    """The shape of one cell's K/V across layers, in this context's native layout."""

    n_stream: int
    n_layer: int
    k_type: int
    k_row: int  # bytes of one cell's K in one layer
    v_type: int
    v_trans: bool
    v_elem: int  # bytes of one V element (v_trans only; else 0)
    n_embd_v: int  # V elements per cell (v_trans only; else 0)
    v_row: int  # bytes of one cell's V in one layer

    @property
    def cell_bytes(self) -> int:
        return self.n_layer * (self.k_row + self.v_row)

    def describe(self) -> str:
        """A stable string naming everything that fixes the KV bytes (not n_stream)."""
        return (
            f"{STATE_VERSION};layers={self.n_layer};k={self.k_type}/{self.k_row};"
            f"v={self.v_type}/{self.v_row};vt={int(self.v_trans)}"
        )


@dataclass(frozen=True)
class KvCells:
    """n cells at positions 0..n-1: K as (layer, cell, bytes), V per layer in native layout.

    V is (layer, cell, bytes) when not transposed, or (layer, n_embd_v, cell, elem bytes)
    when transposed. Arrays may be views into `raw`: the checked blob they were parsed
    from, which llama.cpp can take back as it is (into any slot) when its cells were in
    position order.
    """

    layout: KvLayout
    n: int
    k: list[Bytes]
    v: list[Bytes]
    raw: bytes | bytearray | memoryview | None = None

    @property
    def nbytes(self) -> int:
        return self.n * self.layout.cell_bytes


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.buf = memoryview(data).cast("B")
        self.at = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise StateFormatError("KV state is truncated")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack_from("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.take(8))[0])


def parse(blob: bytes | memoryview, expect: KvLayout | None = None) -> KvCells:
    """Parse and validate one sequence's state; cells come back sorted by position."""
    r = _Reader(blob)
    if r.u32() != SEQ_MAGIC:
        raise StateFormatError("KV state has the wrong magic")
    r.i32()  # the source sequence id: not used on import
    n_stream = r.u32()
    if not 1 <= n_stream <= 256:
        raise StateFormatError(f"KV state has {n_stream} streams")
    cells: KvCells | None = None
    for _ in range(n_stream):
        count = r.u32()
        if count == 0:
            continue
        if cells is not None:
            raise StateFormatError("KV state holds cells in more than one stream")
        cells = _parse_stream(r, count, n_stream, expect)
    if r.at != len(r.buf):
        raise StateFormatError(f"KV state has {len(r.buf) - r.at} trailing bytes")
    if cells is None:
        if expect is None:
            raise StateFormatError("KV state holds no cells")
        return KvCells(expect, 0, [], [])
    return cells if cells.raw is None else KvCells(cells.layout, cells.n, cells.k, cells.v, blob)


def _parse_stream(r: _Reader, count: int, n_stream: int, expect: KvLayout | None) -> KvCells:
    meta = np.frombuffer(r.take(12 * count), dtype=[("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])
    if not np.all(meta["n"] == 1):
        raise StateFormatError("KV state has cells shared between sequences")
    pos = meta["pos"]
    order = np.argsort(pos, kind="stable")
    if not np.array_equal(pos[order], np.arange(count, dtype=np.int32)):
        raise StateFormatError("KV state positions are not exactly 0..n-1")
    v_trans = r.u32()
    n_layer = r.u32()
    if v_trans not in (0, 1) or not 1 <= n_layer <= 1024:
        raise StateFormatError("KV state has a bad layer header")
    k: list[Bytes] = []
    k_type = k_row = -1
    for _ in range(n_layer):
        t, row = r.i32(), r.u64()
        if (k_type, k_row) not in ((-1, -1), (t, row)) or not 0 < row < 1 << 24:
            raise StateFormatError("KV state K rows differ between layers")
        k_type, k_row = t, row
        k.append(np.frombuffer(r.take(count * row), dtype=np.uint8).reshape(count, row))
    v: list[Bytes] = []
    v_type = v_row = v_elem = n_embd_v = -1
    for _ in range(n_layer):
        t = r.i32()
        if v_trans:
            elem, embd = r.u32(), r.u32()
            if (v_elem, n_embd_v) not in ((-1, -1), (elem, embd)) or not 0 < elem * embd < 1 << 24:
                raise StateFormatError("KV state V shapes differ between layers")
            v_elem, n_embd_v, row = elem, embd, elem * embd
            data = np.frombuffer(r.take(count * row), dtype=np.uint8)
            v.append(data.reshape(embd, count, elem))
        else:
            row = r.u64()
            if v_row not in (-1, row) or not 0 < row < 1 << 24:
                raise StateFormatError("KV state V rows differ between layers")
            v.append(np.frombuffer(r.take(count * row), dtype=np.uint8).reshape(count, row))
        if v_type not in (-1, t):
            raise StateFormatError("KV state V types differ between layers")
        v_type, v_row = t, row
    layout = KvLayout(
        n_stream=n_stream,
        n_layer=n_layer,
        k_type=k_type,
        k_row=k_row,
        v_type=v_type,
        v_trans=bool(v_trans),
        v_elem=max(v_elem, 0),
        n_embd_v=max(n_embd_v, 0),
        v_row=v_row,
    )
    if expect is not None and layout != expect:
        raise StateFormatError("KV state does not match this context's KV layout")
    if not np.array_equal(order, np.arange(count)):
        k = [a[order] for a in k]
        v = [a[:, order] if layout.v_trans else a[order] for a in v]
        return KvCells(layout, count, k, v)
    return KvCells(layout, count, k, v, raw=b"")  # parse() puts the real blob in


def cut(cells: KvCells, p0: int, p1: int) -> bytes:
    """The block payload of cells [p0, p1): every layer's K rows, then V, native layout."""
    if not 0 <= p0 < p1 <= cells.n:
        raise ValueError(f"bad block range [{p0}, {p1}) of {cells.n} cells")
    parts: list[bytes] = [a[p0:p1].tobytes() for a in cells.k]
    if cells.layout.v_trans:
        parts += [a[:, p0:p1].tobytes() for a in cells.v]
    else:
        parts += [a[p0:p1].tobytes() for a in cells.v]
    return b"".join(parts)


def join(
    layout: KvLayout, payloads: Sequence[bytes | memoryview], counts: Sequence[int], seq_id: int = 0
) -> KvCells:
    """Cells from consecutive block payloads of `counts[i]` cells each (sizes checked),
    built straight into one blob for llama.cpp: one copy, two numpy operations a block."""
    lay = layout
    n = sum(counts)
    for payload, c in zip(payloads, counts, strict=True):
        if len(payload) != c * lay.cell_bytes:
            raise StateFormatError(f"a KV block holds {len(payload)} bytes, not {c * lay.cell_bytes}")
    k_stride = 12 + n * lay.k_row  # a layer's header (i32 type + u64 row, or + 2 u32) and rows
    v_stride = 12 + n * lay.v_row
    data_at = 16 + 12 * n + 8
    size = data_at + lay.n_layer * (k_stride + v_stride) + 4 * (lay.n_stream - 1)
    # np.empty: unlike bytearray, it does not zero 40+ MB that are overwritten anyway.
    out = np.empty(size, dtype=np.uint8)
    blob = memoryview(out.data)
    at = _header_into(blob, lay, n, seq_id)
    for layer in range(lay.n_layer):
        struct.pack_into("<iQ", blob, at + layer * k_stride, lay.k_type, lay.k_row)
    v_at = at + lay.n_layer * k_stride
    for layer in range(lay.n_layer):
        if lay.v_trans:
            struct.pack_into("<iII", blob, v_at + layer * v_stride, lay.v_type, lay.v_elem, lay.n_embd_v)
        else:
            struct.pack_into("<iQ", blob, v_at + layer * v_stride, lay.v_type, lay.v_row)
    out[v_at + lay.n_layer * v_stride :] = 0  # the other streams' cell counts
    # Strided views of all layers at once, stepping over the per-layer headers.
    k_dest = np.lib.stride_tricks.as_strided(
        out[at + 12 :], shape=(lay.n_layer, n, lay.k_row), strides=(k_stride, lay.k_row, 1)
    )
    if lay.v_trans:
        v_dest = np.lib.stride_tricks.as_strided(
            out[v_at + 12 :],
            shape=(lay.n_layer, lay.n_embd_v, n, lay.v_elem),
            strides=(v_stride, n * lay.v_elem, lay.v_elem, 1),
        )
    else:
        v_dest = np.lib.stride_tricks.as_strided(
            out[v_at + 12 :], shape=(lay.n_layer, n, lay.v_row), strides=(v_stride, lay.v_row, 1)
        )
    p0 = 0
    for payload, c in zip(payloads, counts, strict=True):
        data = np.frombuffer(payload, dtype=np.uint8)
        k_bytes = lay.n_layer * c * lay.k_row
        k_dest[:, p0 : p0 + c] = data[:k_bytes].reshape(lay.n_layer, c, lay.k_row)
        if lay.v_trans:
            v_src = data[k_bytes:].reshape(lay.n_layer, lay.n_embd_v, c, lay.v_elem)
            v_dest[:, :, p0 : p0 + c] = v_src
        else:
            v_dest[:, p0 : p0 + c] = data[k_bytes:].reshape(lay.n_layer, c, lay.v_row)
        p0 += c
    return parse(blob, layout)


def _header_into(blob: memoryview, lay: KvLayout, n: int, seq_id: int) -> int:
    """Write the blob's header and cell metadata; return the offset of the layer data.

    The cells go in stream 0; the other streams' zero counts are the blob's last bytes.
    """
    struct.pack_into("<IiI", blob, 0, SEQ_MAGIC, seq_id, lay.n_stream)
    struct.pack_into("<I", blob, 12, n)
    at = 16
    meta = np.frombuffer(blob, dtype=[("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")], count=n, offset=at)
    meta["pos"] = np.arange(n, dtype=np.int32)
    meta["n"] = 1
    meta["seq"] = seq_id
    at += 12 * n
    struct.pack_into("<II", blob, at, int(lay.v_trans), lay.n_layer)
    return at + 8


def assemble(cells: KvCells) -> bytes | bytearray | memoryview:
    """One blob that llama_state_seq_set_data accepts for any slot of this context.

    The cells' own checked blob when they have one; otherwise one built from the arrays.
    (llama.cpp reads a sequence's cells into the target's stream whatever stream index and
    source id the blob names.)
    """
    if cells.raw is not None:
        return cells.raw
    payloads = [cut(cells, 0, cells.n)] if cells.n else []
    return join(cells.layout, payloads, [cells.n] if cells.n else []).raw or b""


def head(cells: KvCells, n: int) -> KvCells:
    """The first n cells (views, no copy)."""
    if not 0 <= n <= cells.n:
        raise ValueError(f"cannot keep {n} of {cells.n} cells")
    if n == cells.n:
        return cells
    v = [a[:, :n] if cells.layout.v_trans else a[:n] for a in cells.v]
    return KvCells(cells.layout, n, [a[:n] for a in cells.k], v)  # no raw: it holds all cells
