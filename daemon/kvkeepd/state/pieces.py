"""States cut into pieces (checkpoint blocks) and joined back into one blob for llama.cpp.

A piece of a KV section is the payload of cells [a, b) of every layer, K then V, in this
context's native layout; `assemble` writes a blob with every cell at the index of its
position (cells below a sliding window zero-filled), which is where an uninterrupted run has
them. Nothing here calls llama.cpp.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from kvkeepd.state.cells import CELL_META, Bytes, KvCells, RecurrentCells, Section, SeqKv, covered, parse
from kvkeepd.state.layout import SEQ_MAGIC, KvLayout, RecurrentLayout, StateFormatError, StateLayout

log = logging.getLogger(__name__)

# ---- pieces ---------------------------------------------------------------------------------


def cut(cells: KvCells, a: int, b: int) -> bytes:
    """The payload of positions [a, b) of a KV section: every layer's K rows, then V."""
    if not cells.p0 <= a < b <= cells.p0 + cells.n:
        raise ValueError(f"bad range [{a}, {b}) of [{cells.p0}, {cells.p0 + cells.n})")
    ks: list[list[Bytes]] = [[] for _ in cells.layout.k]
    vs: list[list[Bytes]] = [[] for _ in cells.layout.v]
    start = cells.p0
    for count, k, v in cells.runs:
        lo, hi = max(a, start) - start, min(b, start + count) - start
        if lo < hi:
            for i, arr in enumerate(k):
                ks[i].append(arr[lo:hi])
            for i, arr in enumerate(v):
                vs[i].append(arr[:, lo:hi] if cells.layout.v_trans else arr[lo:hi])
        start += count
    axis = 1 if cells.layout.v_trans else 0
    parts = [np.concatenate(x).tobytes() for x in ks]
    parts += [np.concatenate(x, axis=axis).tobytes() for x in vs]
    return b"".join(parts)


def piece(
    lay: KvLayout, payload: bytes | memoryview, count: int
) -> tuple[int, tuple[Bytes, ...], tuple[Bytes, ...]]:
    """A run of `count` cells viewing a payload made by `cut` (no copy); sizes checked."""
    if len(payload) != count * lay.cell_bytes:
        raise StateFormatError(f"a KV piece holds {len(payload)} bytes, not {count * lay.cell_bytes}")
    data = np.frombuffer(payload, dtype=np.uint8)
    if lay.uniform:
        # Every layer alike: two reshapes, the layers' views taken in C (a restore makes
        # one piece per block, each with two views per layer).
        n_layer, row = lay.n_layer, lay.k[0][1]
        _, a, b = lay.v[0]
        k_end = n_layer * count * row
        ks = data[:k_end].reshape(n_layer, count, row)
        vs = data[k_end:].reshape((n_layer, b, count, a) if lay.v_trans else (n_layer, count, a))
        return count, tuple(ks), tuple(vs)
    at = 0
    k = []
    for _, row in lay.k:
        k.append(data[at : at + count * row].reshape(count, row))
        at += count * row
    v = []
    for _, a, b in lay.v:
        size = count * a * (b if lay.v_trans else 1)
        arr = data[at : at + size]
        v.append(arr.reshape(b, count, a) if lay.v_trans else arr.reshape(count, a))
        at += size
    return count, tuple(k), tuple(v)


def cells_from(
    lay: KvLayout, p0: int, runs: Iterable[tuple[int, tuple[Bytes, ...], tuple[Bytes, ...]]]
) -> KvCells:
    runs = tuple(runs)
    return KvCells(lay, p0, sum(r[0] for r in runs), runs)


def recurrent_from(lay: RecurrentLayout, pos: int, payload: bytes | memoryview) -> RecurrentCells:
    if len(payload) != (lay.nbytes if pos >= 0 else 0):
        raise StateFormatError(f"a recurrent snapshot holds {len(payload)} bytes, not {lay.nbytes}")
    return RecurrentCells(lay, pos, payload)


def build(layout: StateLayout, n: int, sections: Sequence[Section]) -> SeqKv:
    """A SeqKv from checked pieces; positions are checked as `parse` does."""
    if tuple(s.layout for s in sections) != layout.sections:
        raise StateFormatError("the pieces do not match this context's layout")
    if covered(layout, sections) != n:
        raise StateFormatError("the pieces do not cover the sequence")
    return SeqKv(layout, n, tuple(sections))


def head(kv: SeqKv, m: int, recurrent: RecurrentCells | None = None) -> SeqKv | None:
    """The state after the first m positions, when it can be cut from this one: always for
    full-attention KV; for a window only while it holds all of [m - W, m); a recurrent state
    only at its own position, or from `recurrent`, a snapshot taken after position m - 1.
    None otherwise (and for m = 0: nothing to load)."""
    if not 0 <= m <= kv.n:
        raise ValueError(f"cannot keep {m} of {kv.n} positions")
    if m == 0:
        return None
    if m == kv.n and recurrent is None:
        return kv
    out: list[Section] = []
    for s in kv.sections:
        if isinstance(s, RecurrentCells):
            if m == kv.n and recurrent is None:
                out.append(s)
            elif recurrent is not None and recurrent.pos == m - 1:
                out.append(recurrent)
            else:
                return None
            continue
        want = s.layout.first(m)
        if s.p0 > want:
            return None
        out.append(_slice(s, want, m))
    return SeqKv(kv.layout, m, tuple(out))


def at_boundary(kv: SeqKv, n: int, partial: Sequence[Section]) -> SeqKv:
    """The state after n positions: the first n cells of kv's full-attention section, and
    sliding-window and recurrent sections taken at n (a snapshot made there)."""
    if kv.n < n:
        raise ValueError(f"cannot take {n} positions of a state of {kv.n}")
    given = iter(partial)
    sections: list[Section] = []
    for s in kv.sections:
        if isinstance(s, KvCells) and not s.layout.window:
            sections.append(_slice(s, 0, n))
        else:
            sections.append(next(given))
    return build(kv.layout, n, sections)


def can_cut(layout: StateLayout, window_from: int, m: int) -> bool:
    """Whether KV-only state whose window cells are real from `window_from` on can be cut
    to its first m positions in place."""
    win = layout.windowed
    return win is None or win.first(m) >= window_from


def rewind(kv: SeqKv, m: int, snapshots: Sequence[RecurrentCells]) -> SeqKv | None:
    """The longest state of at most m positions that can be made from `kv` and recurrent
    snapshots of the same history; None when only evaluating from the start can."""
    if kv.layout.recurrent is None or m == kv.n:
        return head(kv, m)
    for snap in sorted(snapshots, key=lambda r: r.pos, reverse=True):
        if snap.pos + 1 <= m:
            return head(kv, snap.pos + 1, snap)
    return None


def _slice(cells: KvCells, a: int, b: int) -> KvCells:
    runs = []
    start = cells.p0
    for count, k, v in cells.runs:
        lo, hi = max(a, start) - start, min(b, start + count) - start
        if lo < hi:
            vv = tuple(x[:, lo:hi] if cells.layout.v_trans else x[lo:hi] for x in v)
            runs.append((hi - lo, tuple(x[lo:hi] for x in k), vv))
        start += count
    return KvCells(cells.layout, a, max(0, b - a), tuple(runs))


# ---- assembly -------------------------------------------------------------------------------


def blob_size(kv: SeqKv) -> int:
    """The bytes of `assemble(kv)` (a state without a raw blob)."""
    return 8 + sum(_section_size(s, kv.n) for s in kv.sections)


def blob_bound(layout: StateLayout, n: int) -> int:
    """The most bytes an assembled state of n positions of this layout takes."""
    size = 8
    for s in layout.sections:
        if isinstance(s, RecurrentLayout):
            size += 4 + 8 + 8 + 12 * len(s.rows) + s.nbytes
        else:
            size += 4 + 4 * s.n_stream + 12 * n + 8 + s.n_layer * 24 + n * s.cell_bytes
    return size


def assemble(kv: SeqKv, seq_id: int = 0, into: Bytes | None = None) -> bytes | bytearray | memoryview:
    """One blob that llama_state_seq_set_data accepts for any slot of this context, with
    every KV cell at the index of its position (cells below a window zero-filled); written
    into `into` (a uint8 array of blob_size(kv) bytes) when given."""
    if kv.raw is not None:
        return kv.raw
    size = blob_size(kv)
    # np.empty: unlike bytearray, it does not zero the tens of MB that are overwritten anyway.
    out = np.empty(size, dtype=np.uint8) if into is None else into
    assert out.shape == (size,)
    blob = memoryview(out.data)
    struct.pack_into("<Ii", blob, 0, SEQ_MAGIC, seq_id)
    at = 8
    for s in kv.sections:
        at = _write_kv(out, at, s, kv.n, seq_id) if isinstance(s, KvCells) else _write_rec(blob, at, s)
    assert at == size
    return blob


def _section_size(s: Section, n: int) -> int:
    if isinstance(s, RecurrentCells):
        head = 4 + (8 if s.pos >= 0 else 0) + 8
        return head + 12 * len(s.layout.rows) + len(s.data)
    lay = s.layout
    size = 4 + 4 * lay.n_stream
    if n:
        size += 12 * n + 8 + lay.n_layer * 24 + n * lay.cell_bytes
    return size


def _write_kv(out: Bytes, at: int, s: KvCells, n: int, seq_id: int) -> int:
    lay = s.layout
    k_at, v_at, end = _kv_frame(out, at, lay, n, seq_id)
    if not n:
        return end
    pad = s.p0  # cells below the window: zeros
    for layer, (_, row) in enumerate(lay.k):
        dest = out[k_at[layer] : k_at[layer] + n * row].reshape(n, row)
        dest[:pad] = 0
        _fill(dest[pad:], [k[layer] for _, k, _ in s.runs])
    stage = _Stage()
    for layer, (_, a, b) in enumerate(lay.v):
        if lay.v_trans:
            vdest = out[v_at[layer] : v_at[layer] + n * a * b].reshape(b, n * a)
            vdest[:, : pad * a] = 0
            _fill_rows(vdest[:, pad * a :], [v[layer] for _, _, v in s.runs], stage)
        else:
            dest = out[v_at[layer] : v_at[layer] + n * a].reshape(n, a)
            dest[:pad] = 0
            _fill(dest[pad:], [v[layer] for _, _, v in s.runs])
    return end


def _kv_frame(out: Bytes, at: int, lay: KvLayout, n: int, seq_id: int) -> tuple[list[int], list[int], int]:
    """Write a KV section of n cells at `at`, all but its rows: the stream header, the cells'
    positions and every layer's row header. Returns where each layer's K rows and V rows
    start, and where the section ends."""
    blob = memoryview(out.data)
    struct.pack_into("<II", blob, at, lay.n_stream, n)
    at += 8
    k_at: list[int] = []
    v_at: list[int] = []
    if n:
        meta = np.frombuffer(blob, dtype=CELL_META, count=n, offset=at)
        meta["pos"] = np.arange(n, dtype=np.int32)
        meta["n"] = 1
        meta["seq"] = seq_id
        at += 12 * n
        struct.pack_into("<II", blob, at, int(lay.v_trans), lay.n_layer)
        at += 8
        for t, row in lay.k:
            struct.pack_into("<iQ", blob, at, t, row)
            k_at.append(at + 12)
            at += 12 + n * row
        for t, a, b in lay.v:
            if lay.v_trans:
                struct.pack_into("<iII", blob, at, t, a, b)
            else:
                struct.pack_into("<iQ", blob, at, t, a)
            v_at.append(at + 12)
            at += 12 + n * a * (b if lay.v_trans else 1)
    out[at : at + 4 * (lay.n_stream - 1)] = 0  # the other streams hold no cells
    return k_at, v_at, at + 4 * (lay.n_stream - 1)


class Scatter:
    """The blob llama.cpp takes for n positions, made by reading pieces straight into it.

    For a layout of one full-attention KV section with V not transposed, a piece's payload
    (`cut`'s order: every layer's K rows, then every layer's V rows, of cells [a, b)) is
    2 x n_layer runs of bytes, each contiguous in the blob. A restore that reads each block
    into those places needs no assembly: the state is copied once from the file and once
    into llama.cpp, as a slot restore of llama-server does. Other layouts (a window to
    place, a recurrent state, V transposed into rows of every cell) are assembled.
    """

    def __init__(self, layout: StateLayout, n: int, into: Bytes) -> None:
        """`into`: a uint8 array of `Scatter.size(layout, n)` bytes; its metadata is written
        now, its rows by whoever fills `regions`."""
        (lay,) = layout.sections
        assert isinstance(lay, KvLayout) and n > 0
        self.layout, self.n, self.blob = layout, n, into
        struct.pack_into("<Ii", memoryview(into.data), 0, SEQ_MAGIC, 0)
        k_at, v_at, end = _kv_frame(into, 8, lay, n, 0)
        assert end == into.shape[0]
        # Where each layer's K rows, then V rows, start, and one cell's row of each.
        rows = [row for _, row in lay.k] + [row for _, row, _ in lay.v]
        self._rows = list(zip(k_at + v_at, rows, strict=True))

    @staticmethod
    def fits(layout: StateLayout) -> bool:
        """Whether states of this layout can be read in place."""
        if len(layout.sections) != 1:
            return False
        (lay,) = layout.sections
        return isinstance(lay, KvLayout) and not lay.window and not lay.v_trans

    @staticmethod
    def size(layout: StateLayout, n: int) -> int:
        return blob_bound(layout, n)

    def regions(self, a: int, b: int) -> list[memoryview]:
        """The places in the blob of a piece of cells [a, b), in its payload's order."""
        if not 0 <= a < b <= self.n:
            raise ValueError(f"bad range [{a}, {b}) of {self.n} cells")
        data = memoryview(self.blob.data)
        return [data[at + a * row : at + b * row] for at, row in self._rows]

    def place(self, a: int, b: int, payload: bytes | memoryview) -> None:
        """Copy a piece's payload (as `cut` made it) to its places."""
        at = 0
        view = memoryview(payload)
        for region in self.regions(a, b):
            region[:] = view[at : at + len(region)]
            at += len(region)
        if at != len(view):
            raise StateFormatError(f"a KV piece holds {len(view)} bytes, not {at}")

    def state(self) -> SeqKv:
        """The state the filled blob holds, parsed (and so checked) as an export is."""
        kv = parse(memoryview(self.blob.data), self.layout)
        if kv.n != self.n or kv.raw is None:
            raise StateFormatError("a state read in place does not parse back whole")
        return kv


def _fill(dest: Bytes, sources: Sequence[Bytes]) -> None:
    """Sources of (cells, row bytes), one after another in dest's rows."""
    at = 0
    for src in sources:
        count = src.shape[0]
        dest[at : at + count] = src
        at += count


class _Stage:
    """A staging array kept across the layers of one assembly (their runs have one shape)."""

    def __init__(self) -> None:
        self.array: np.ndarray | None = None

    def get(self, shape: tuple[int, int, int]) -> np.ndarray:
        if self.array is None or self.array.shape != shape:
            self.array = np.empty(shape, dtype=np.uint8)
        return self.array


def _fill_rows(dest: np.ndarray, sources: Sequence[Bytes], stage: _Stage) -> None:
    """Transposed V sources of (n_embd_v, cells, elem bytes), one after another along the
    cells of dest, a (n_embd_v, cells * elem bytes) view.

    Each row of a source is a short piece of its destination row (128 bytes for a 64-token
    block of f16), and one numpy assignment per source copied its rows one call at a time:
    most of a restore's assembly. Runs of one size are first copied whole into a staging
    array, then moved in one transposed copy (half the time, measured).
    """
    rows = dest.shape[0]
    at = i = 0
    while i < len(sources):
        cells, elem = sources[i].shape[1], sources[i].shape[2]
        j = i + 1
        while j < len(sources) and sources[j].shape[1] == cells:
            j += 1
        width = cells * elem
        if j - i == 1:
            dest[:, at : at + width] = sources[i].reshape(rows, width)
        else:
            staged = stage.get((j - i, rows, width))
            for g in range(j - i):
                staged[g] = sources[i + g].reshape(rows, width)
            # A view (the columns of each row are contiguous), so the copy lands in dest.
            target = dest[:, at : at + (j - i) * width].reshape(rows, j - i, width)
            target[...] = staged.transpose(1, 0, 2)
        at += (j - i) * width
        i = j


def _write_rec(blob: memoryview, at: int, s: RecurrentCells) -> int:
    if s.pos >= 0:
        struct.pack_into("<IiI", blob, at, 1, s.pos, 0)
        at += 12
    else:
        struct.pack_into("<I", blob, at, 0)
        at += 4
    struct.pack_into("<II", blob, at, 0, s.layout.n_layer)
    at += 8
    data = memoryview(s.data)
    used = 0
    for t, row in s.layout.rows:
        struct.pack_into("<iQ", blob, at, t, row)
        at += 12
        if s.pos >= 0:
            blob[at : at + row] = data[used : used + row]
            at += row
            used += row
    return at


def assembled(kv: SeqKv, layout: StateLayout, into: np.ndarray) -> SeqKv | None:
    """kv as one blob (written into `into`), parsed again: its sections are views of the
    blob, not of blocks. None (logged) if it does not parse back whole."""
    blob = assemble(kv, into=into)
    try:
        whole = parse(blob, layout)
    except StateFormatError:
        log.exception("an assembled state does not parse back")
        return None
    return whole if whole.raw is not None and whole.n == kv.n else None
