"""A sequence's computed state, parsed from llama.cpp's blob and validated (see layout.py
for the blob's format). Nothing here calls llama.cpp.

A sliding-window section holds only the positions the next token can still see, [n - W, n).
Where its cells sit in the cache changes logits (attention sums over cells in index order):
a session evaluated from an empty slot has position p in cell p, so an import puts them there
too, with zero cells below the window (pieces.assemble). Zero K/V in a masked cell adds
exactly nothing, as the real, masked cells of an uninterrupted run do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvkeepd.state.layout import (
    MAX_ROW,
    KvLayout,
    Reader,
    RecurrentLayout,
    SectionLayout,
    StateFormatError,
    StateLayout,
    read_header,
)

Bytes = npt.NDArray[np.uint8]
CELL_META = np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])


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
        r = Reader(blob)
        read_header(r)
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
    raise StateFormatError(f"the state is not a layout kvkeep knows ({'; '.join(problems)})")


def _discover_kv(r: Reader, window: int) -> KvLayout:
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


def _discover_recurrent(r: Reader) -> RecurrentLayout:
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
    r = Reader(blob)
    read_header(r)
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
    n = covered(layout, sections)
    # A window section is re-placed on import (see the module docstring) unless it starts at 0.
    reusable = in_order and all(not isinstance(s, KvCells) or s.p0 == 0 for s in sections)
    return SeqKv(layout, n, tuple(sections), blob if reusable else None)


def parse_partial(blob: bytes | bytearray | memoryview, layout: StateLayout, n: int) -> tuple[Section, ...]:
    """The sliding-window and recurrent sections after n positions, as
    `llama_state_seq_get_data_ext(..., PARTIAL_ONLY)` writes them (models that have one)."""
    if not layout.partial:
        raise StateFormatError("this model's state has no partial sections")
    r = Reader(blob)
    read_header(r)
    sections: list[Section] = []
    for sec in layout.partial:
        sections.append(_parse_kv(r, sec)[0] if isinstance(sec, KvLayout) else _parse_recurrent(r, sec))
    if r.left:
        raise StateFormatError(f"the state has {r.left} trailing bytes")
    for s in sections:
        if isinstance(s, KvCells):
            if s.n and (s.p0, s.p0 + s.n) != (s.layout.first(n), n):
                held = f"[{s.p0}, {s.p0 + s.n})"
                raise StateFormatError(f"a window holds {held}, not its last positions of {n}")
        elif s.pos != n - 1:
            raise StateFormatError(f"the recurrent state is at {s.pos}, not {n - 1}")
    return tuple(sections)


def _parse_kv(r: Reader, lay: KvLayout) -> tuple[KvCells, bool]:
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


def _parse_stream(r: Reader, lay: KvLayout, count: int) -> tuple[KvCells, bool]:
    meta = np.frombuffer(r.take(12 * count), dtype=CELL_META)
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


def _parse_recurrent(r: Reader, lay: RecurrentLayout) -> RecurrentCells:
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


def covered(layout: StateLayout, sections: Sequence[Section]) -> int:
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
