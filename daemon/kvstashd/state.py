"""A sequence's computed state <-> bytes: llama.cpp's sequence-state blob, parsed into
sections, validated, cut into pieces and reassembled. Nothing here calls llama.cpp.

`llama_state_seq_get_data(seq)` of the pinned llama.cpp writes `u32 magic, i32 seq id`, then
one section per memory the model has, in this order (src/llama-kv-cache-iswa.cpp,
llama-memory-hybrid.cpp): a plain model one KV section; an iSWA model (Gemma 2/3, gpt-oss) the
full-attention KV section, then the sliding-window one; a hybrid model its attention KV
section(s), then a recurrent section; a recurrent model only the latter.

KV section:
    u32 n_stream; per stream: u32 cell_count, and when it is not 0:
        per cell: i32 pos, u32 n_seq_id (1), i32 seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K
        per layer, v_trans=0: i32 v_type, u64 v_row_bytes, cell_count rows of V
        per layer, v_trans=1: i32 v_type, u32 v_elem_bytes, u32 n_embd_v,
                              n_embd_v rows of cell_count elements (V transposed)
Recurrent section (one cell per sequence: the summary of every token so far):
    u32 cell_count (0 or 1); per cell: i32 pos, u32 n_seq_id (0)
    u32 s_trans (0), u32 n_layer; then per layer that has them, R rows then S rows,
    each as i32 type, u64 row_bytes, cell_count rows

A sliding-window section holds only the positions the next token can still see, [n - W, n).
Where its cells sit in the cache changes logits (attention sums over cells in index order):
a session evaluated from an empty slot has position p in cell p, so an import puts them there
too, with zero cells below the window (`assemble`). Zero K/V in a masked cell adds exactly
nothing, as the real, masked cells of an uninterrupted run do.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstashd.errors import CorruptCheckpoint

SEQ_MAGIC = 0xAF143CD8
# Bumped when the layout above changes with a llama.cpp upgrade: checkpoints made under
# another state version restore by evaluating their tokens again.
STATE_VERSION = "llama.cpp-seq-state-2"
MAX_ROW = 1 << 26

Bytes = npt.NDArray[np.uint8]
_META = np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])


class StateFormatError(CorruptCheckpoint):
    """A sequence-state blob that does not match the expected structure."""


@dataclass(frozen=True)
class KvLayout:
    """One KV section: per layer, K and V row shapes; `window` > 0 for sliding-window caches."""

    n_stream: int
    k: tuple[tuple[int, int], ...]  # per layer: (ggml type, bytes of one cell's K)
    v_trans: bool
    v: tuple[tuple[int, int, int], ...]  # per layer: (ggml type, element bytes, elements); not
    # transposed: (type, row bytes, 0)
    window: int = 0

    @property
    def n_layer(self) -> int:
        return len(self.k)

    def v_row(self, layer: int) -> int:
        _, a, b = self.v[layer]
        return a * b if self.v_trans else a

    @property
    def cell_bytes(self) -> int:
        return sum(row for _, row in self.k) + sum(self.v_row(i) for i in range(self.n_layer))

    def first(self, n: int) -> int:
        """The first position this section holds for a sequence of n positions."""
        return max(0, n - self.window) if self.window else 0

    def describe(self) -> str:
        k = ",".join(f"{t}/{r}" for t, r in self.k)
        v = ",".join(f"{t}/{a}/{b}" for t, a, b in self.v)
        return f"kv(w={self.window};vt={int(self.v_trans)};k={k};v={v})"


@dataclass(frozen=True)
class RecurrentLayout:
    """The recurrent section: its layer count and the (type, row bytes) of every R/S row set."""

    n_layer: int
    rows: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(row for _, row in self.rows)

    def describe(self) -> str:
        return f"rec(layers={self.n_layer};" + ",".join(f"{t}/{r}" for t, r in self.rows) + ")"


SectionLayout = KvLayout | RecurrentLayout


@dataclass(frozen=True)
class StateLayout:
    """Every section of a sequence's state, in blob order."""

    sections: tuple[SectionLayout, ...]

    @property
    def kind(self) -> str:
        """kv, iswa, hybrid, hybrid-iswa or recurrent."""
        kv = [s for s in self.sections if isinstance(s, KvLayout)]
        windowed = any(s.window for s in kv)
        if len(kv) == len(self.sections):
            return "iswa" if windowed else "kv"
        if not kv:
            return "recurrent"
        return "hybrid-iswa" if windowed else "hybrid"

    @property
    def full(self) -> KvLayout | None:
        """The full-attention KV section, cut into position blocks."""
        return next((s for s in self.sections if isinstance(s, KvLayout) and not s.window), None)

    @property
    def windowed(self) -> KvLayout | None:
        return next((s for s in self.sections if isinstance(s, KvLayout) and s.window), None)

    @property
    def recurrent(self) -> RecurrentLayout | None:
        return next((s for s in self.sections if isinstance(s, RecurrentLayout)), None)

    def max_bytes(self, n: int) -> int:
        """The most bytes the state of n positions takes."""
        total = 0
        for s in self.sections:
            if isinstance(s, KvLayout):
                total += (min(n, s.window) if s.window else n) * s.cell_bytes
            else:
                total += s.nbytes
        return total

    def describe(self) -> str:
        """A stable string naming everything that fixes the state's bytes (not n_stream)."""
        return f"{STATE_VERSION};" + ";".join(s.describe() for s in self.sections)


@dataclass(frozen=True)
class KvCells:
    """Cells of one KV section at positions [p0, p0 + n), in one or more runs of arrays.

    Per run and layer: K as (cells, row bytes); V as (cells, row bytes), or (n_embd_v, cells,
    elem bytes) when transposed. Arrays are often views into a blob or a block payload.
    """

    layout: KvLayout
    p0: int
    n: int
    runs: tuple[tuple[int, tuple[Bytes, ...], tuple[Bytes, ...]], ...]

    @property
    def nbytes(self) -> int:
        return self.n * self.layout.cell_bytes


@dataclass(frozen=True)
class RecurrentCells:
    """The recurrent state after position `pos` (-1: empty), its rows as one payload."""

    layout: RecurrentLayout
    pos: int
    data: bytes | memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)


Section = KvCells | RecurrentCells


@dataclass(frozen=True)
class SeqKv:
    """A sequence's state for positions 0..n-1: one section per memory, checked.

    `raw` is a blob llama.cpp can take back as it is (its own export, cells in position
    order, no sliding window to place), or None.
    """

    layout: StateLayout
    n: int
    sections: tuple[Section, ...]
    raw: bytes | bytearray | memoryview | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sections)

    @property
    def window_from(self) -> int:
        """The first position whose sliding-window cells are real (0 without a window)."""
        win = next((s for s in self.sections if isinstance(s, KvCells) and s.layout.window), None)
        return win.p0 if win is not None else 0


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.buf = memoryview(data).cast("B")
        self.at = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise StateFormatError("the state is truncated")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack_from("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.take(8))[0])

    @property
    def left(self) -> int:
        return len(self.buf) - self.at


# ---- discovery ------------------------------------------------------------------------------


def discover(blob: bytes | memoryview, *, recurrent: bool, hybrid: bool, window: int) -> StateLayout:
    """The layout of a probe state (one evaluated token). StateFormatError if it is not one
    this module knows: such models keep only their token history in checkpoints."""
    candidates: list[list[str]]
    if recurrent:
        candidates = [["rec"]]
    elif hybrid:
        candidates = [["kv", "rec"], ["kv", "win", "rec"]]
    else:
        candidates = [["kv"], ["kv", "win"]] if window else [["kv"]]
    problems = []
    for kinds in candidates:
        r = _Reader(blob)
        _header(r)
        try:
            sections: list[SectionLayout] = []
            for kind in kinds:
                if kind == "rec":
                    sections.append(_discover_recurrent(r))
                else:
                    sections.append(_discover_kv(r, window if kind == "win" else 0))
            if r.left:
                raise StateFormatError(f"{r.left} trailing bytes")
            layout = StateLayout(tuple(sections))
            parse(blob, layout)  # everything discovered must also check
            return layout
        except StateFormatError as e:
            problems.append(f"as {'+'.join(kinds)}: {e}")
    raise StateFormatError(f"the state is not a layout kvstash knows ({'; '.join(problems)})")


def _header(r: _Reader) -> None:
    if r.u32() != SEQ_MAGIC:
        raise StateFormatError("the state has the wrong magic")
    r.i32()  # the source sequence id: not used on import


def _discover_kv(r: _Reader, window: int) -> KvLayout:
    n_stream = r.u32()
    if not 1 <= n_stream <= 256:
        raise StateFormatError(f"a KV section with {n_stream} streams")
    found: KvLayout | None = None
    for _ in range(n_stream):
        count = r.u32()
        if count == 0:
            continue
        if found is not None:
            raise StateFormatError("KV cells in more than one stream")
        r.take(12 * count)
        v_trans, n_layer = r.u32(), r.u32()
        if v_trans not in (0, 1) or not 1 <= n_layer <= 4096:
            raise StateFormatError("a bad KV layer header")
        k = []
        for _ in range(n_layer):
            t, row = r.i32(), r.u64()
            _check_row(row)
            r.take(row * count)
            k.append((t, row))
        v = []
        for _ in range(n_layer):
            t = r.i32()
            if v_trans:
                elem, embd = r.u32(), r.u32()
                _check_row(elem * embd)
                r.take(elem * embd * count)
                v.append((t, elem, embd))
            else:
                row = r.u64()
                _check_row(row)
                r.take(row * count)
                v.append((t, row, 0))
        found = KvLayout(n_stream, tuple(k), bool(v_trans), tuple(v), window)
    if found is None:
        raise StateFormatError("a KV section without cells")
    return found


def _discover_recurrent(r: _Reader) -> RecurrentLayout:
    count = r.u32()
    if count != 1:
        raise StateFormatError(f"a recurrent section with {count} cells")
    r.i32()
    if r.u32() != 0:
        raise StateFormatError("a recurrent cell names its sequences")
    if r.u32() != 0:
        raise StateFormatError("a transposed recurrent state")
    n_layer = r.u32()
    rows = []
    while r.left:
        t, row = r.i32(), r.u64()
        if not 0 <= row < MAX_ROW:  # a model's S rows may be empty (LFM2's short convolutions)
            raise StateFormatError(f"a row of {row} bytes")
        r.take(row)
        rows.append((t, row))
    if not 1 <= n_layer <= 4096 or not rows:
        raise StateFormatError("a bad recurrent layer header")
    return RecurrentLayout(n_layer, tuple(rows))


def _check_row(row: int) -> None:
    if not 0 < row < MAX_ROW:
        raise StateFormatError(f"a row of {row} bytes")


# ---- parsing --------------------------------------------------------------------------------


def parse(blob: bytes | bytearray | memoryview, layout: StateLayout) -> SeqKv:
    """Parse and validate one sequence's state against this context's layout.

    KV cells come back sorted by position; the full-attention section must hold exactly
    0..n-1, a sliding-window one exactly its window of that, a recurrent one the state after
    n-1. (llama.cpp itself accepts negative, duplicate and huge positions silently.)
    """
    r = _Reader(blob)
    _header(r)
    sections: list[Section] = []
    in_order = True
    for sec in layout.sections:
        if isinstance(sec, KvLayout):
            cells, ordered = _parse_kv(r, sec)
            in_order = in_order and ordered
            sections.append(cells)
        else:
            sections.append(_parse_recurrent(r, sec))
    if r.left:
        raise StateFormatError(f"the state has {r.left} trailing bytes")
    n = _check_positions(layout, sections)
    # A window section is re-placed on import (see the module docstring) unless it starts at 0.
    reusable = in_order and all(not isinstance(s, KvCells) or s.p0 == 0 for s in sections)
    return SeqKv(layout, n, tuple(sections), blob if reusable else None)


def parse_partial(blob: bytes | bytearray | memoryview, layout: StateLayout) -> RecurrentCells:
    """The recurrent section alone, as `llama_state_seq_get_data_ext(..., PARTIAL_ONLY)` of a
    hybrid or recurrent model writes it."""
    rec = layout.recurrent
    if rec is None:
        raise StateFormatError("this model has no recurrent state")
    r = _Reader(blob)
    _header(r)
    cells = _parse_recurrent(r, rec)
    if r.left:
        raise StateFormatError(f"the state has {r.left} trailing bytes")
    return cells


def _parse_kv(r: _Reader, lay: KvLayout) -> tuple[KvCells, bool]:
    if r.u32() != lay.n_stream:
        raise StateFormatError("the KV section has another number of streams")
    found: tuple[KvCells, bool] | None = None
    for _ in range(lay.n_stream):
        count = r.u32()
        if count == 0:
            continue
        if found is not None:
            raise StateFormatError("KV cells in more than one stream")
        found = _parse_stream(r, lay, count)
    return found if found is not None else (KvCells(lay, 0, 0, ()), True)


def _parse_stream(r: _Reader, lay: KvLayout, count: int) -> tuple[KvCells, bool]:
    meta = np.frombuffer(r.take(12 * count), dtype=_META)
    if not np.all(meta["n"] == 1):
        raise StateFormatError("KV cells shared between sequences")
    pos = meta["pos"]
    order = np.argsort(pos, kind="stable")
    p0 = int(pos[order[0]])
    if p0 < 0 or not np.array_equal(pos[order], np.arange(p0, p0 + count, dtype=np.int32)):
        raise StateFormatError("KV positions are not one contiguous run")
    if (r.u32(), r.u32()) != (int(lay.v_trans), lay.n_layer):
        raise StateFormatError("the KV section does not match this context's layout")
    k: list[Bytes] = []
    for t, row in lay.k:
        if (r.i32(), r.u64()) != (t, row):
            raise StateFormatError("K rows do not match this context's layout")
        k.append(np.frombuffer(r.take(count * row), dtype=np.uint8).reshape(count, row))
    v: list[Bytes] = []
    for t, a, b in lay.v:
        if lay.v_trans:
            if (r.i32(), r.u32(), r.u32()) != (t, a, b):
                raise StateFormatError("V rows do not match this context's layout")
            v.append(np.frombuffer(r.take(count * a * b), dtype=np.uint8).reshape(b, count, a))
        else:
            if (r.i32(), r.u64()) != (t, a):
                raise StateFormatError("V rows do not match this context's layout")
            v.append(np.frombuffer(r.take(count * a), dtype=np.uint8).reshape(count, a))
    ordered = bool(np.array_equal(order, np.arange(count)))
    if not ordered:  # cells in index order after a rewind: sort them (a copy)
        k = [a[order] for a in k]
        v = [a[:, order] if lay.v_trans else a[order] for a in v]
    return KvCells(lay, p0, count, ((count, tuple(k), tuple(v)),)), ordered


def _parse_recurrent(r: _Reader, lay: RecurrentLayout) -> RecurrentCells:
    count = r.u32()
    if count not in (0, 1):
        raise StateFormatError(f"a recurrent section with {count} cells")
    pos = -1
    if count:
        pos = r.i32()
        if pos < 0 or r.u32() != 0:
            raise StateFormatError("a bad recurrent cell")
    if (r.u32(), r.u32()) != (0, lay.n_layer):
        raise StateFormatError("the recurrent section does not match this context's layout")
    parts: list[memoryview] = []
    for t, row in lay.rows:
        if (r.i32(), r.u64()) != (t, row):
            raise StateFormatError("recurrent rows do not match this context's layout")
        parts.append(r.take(row * count))
    data = bytes(b"".join(parts)) if count else b""
    return RecurrentCells(lay, pos, data)


def _check_positions(layout: StateLayout, sections: Sequence[Section]) -> int:
    """The sequence length the sections agree on; StateFormatError if they do not."""
    full = next((s for s in sections if isinstance(s, KvCells) and not s.layout.window), None)
    rec = next((s for s in sections if isinstance(s, RecurrentCells)), None)
    if full is not None:
        n = full.n
    elif rec is not None:
        n = rec.pos + 1
    else:
        win = next(s for s in sections if isinstance(s, KvCells))
        n = win.p0 + win.n
    for s in sections:
        if isinstance(s, KvCells):
            want = s.layout.first(n)
            if (s.n and (s.p0, s.p0 + s.n) != (want, n)) or (not s.n and n):
                raise StateFormatError(f"a KV section holds [{s.p0}, {s.p0 + s.n}), not [{want}, {n})")
        elif s.pos != n - 1:
            raise StateFormatError(f"the recurrent state is at {s.pos}, not {n - 1}")
    return n


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
    if _check_positions(layout, sections) != n:
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


def assemble(kv: SeqKv, seq_id: int = 0) -> bytes | bytearray | memoryview:
    """One blob that llama_state_seq_set_data accepts for any slot of this context, with
    every KV cell at the index of its position (cells below a window zero-filled)."""
    if kv.raw is not None:
        return kv.raw
    size = 8 + sum(_section_size(s, kv.n) for s in kv.sections)
    # np.empty: unlike bytearray, it does not zero the tens of MB that are overwritten anyway.
    out = np.empty(size, dtype=np.uint8)
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
    blob = memoryview(out.data)
    struct.pack_into("<II", blob, at, lay.n_stream, n)
    at += 8
    if n:
        meta = np.frombuffer(blob, dtype=_META, count=n, offset=at)
        meta["pos"] = np.arange(n, dtype=np.int32)
        meta["n"] = 1
        meta["seq"] = seq_id
        at += 12 * n
        struct.pack_into("<II", blob, at, int(lay.v_trans), lay.n_layer)
        at += 8
        pad = s.p0  # cells below the window: zeros
        for layer, (t, row) in enumerate(lay.k):
            struct.pack_into("<iQ", blob, at, t, row)
            dest = out[at + 12 : at + 12 + n * row].reshape(n, row)
            dest[:pad] = 0
            _fill(dest[pad:], [k[layer] for _, k, _ in s.runs], 0)
            at += 12 + n * row
        for layer, (t, a, b) in enumerate(lay.v):
            if lay.v_trans:
                struct.pack_into("<iII", blob, at, t, a, b)
                vdest = out[at + 12 : at + 12 + n * a * b].reshape(b, n, a)
                vdest[:, :pad] = 0
                _fill(vdest[:, pad:], [v[layer] for _, _, v in s.runs], 1)
                at += 12 + n * a * b
            else:
                struct.pack_into("<iQ", blob, at, t, a)
                dest = out[at + 12 : at + 12 + n * a].reshape(n, a)
                dest[:pad] = 0
                _fill(dest[pad:], [v[layer] for _, _, v in s.runs], 0)
                at += 12 + n * a
    out[at : at + 4 * (lay.n_stream - 1)] = 0  # the other streams hold no cells
    return at + 4 * (lay.n_stream - 1)


def _fill(dest: Bytes, sources: Sequence[Bytes], axis: int) -> None:
    at = 0
    for src in sources:
        count = src.shape[axis]
        if axis:
            dest[:, at : at + count] = src
        else:
            dest[at : at + count] = src
        at += count


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
