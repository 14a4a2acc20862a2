"""The shape of a sequence's state: which sections a model's memory writes, and the row
sizes of each, learned once from a real state of the loaded model (`discover`).

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

Layouts kvkeep does not know (M-RoPE cell extensions, shared-cell caches, chunked windows)
fail discovery: such models keep only their token history in checkpoints.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

from kvkeepd.errors import CorruptCheckpoint

SEQ_MAGIC = 0xAF143CD8
# Bumped when the layout above changes with a llama.cpp upgrade: checkpoints made under
# another state version restore by evaluating their tokens again.
STATE_VERSION = "llama.cpp-seq-state-2"
MAX_ROW = 1 << 26


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

    @cached_property  # asked for every piece of every restore
    def cell_bytes(self) -> int:
        return sum(row for _, row in self.k) + sum(self.v_row(i) for i in range(self.n_layer))

    @cached_property
    def uniform(self) -> bool:
        """Whether there are layers and every one has the same K row and V shape (most models)."""
        return len({row for _, row in self.k}) == 1 and len({(a, b) for _, a, b in self.v}) == 1

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

    @property
    def partial(self) -> tuple[SectionLayout, ...]:
        """The sections a partial export writes (sliding windows, recurrent states); empty
        when the model has none (a partial export of a plain cache writes all of it)."""
        return tuple(s for s in self.sections if isinstance(s, RecurrentLayout) or s.window)

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


class Reader:
    """Bounds-checked little-endian reads over a buffer."""

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


def read_header(r: Reader) -> None:
    """The blob's magic and source sequence id."""
    if r.u32() != SEQ_MAGIC:
        raise StateFormatError("the state has the wrong magic")
    r.i32()  # the source sequence id: not used on import
