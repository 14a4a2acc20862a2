"""Streams: how many KV streams the context has, and what each is for.

With one KV stream per sequence (the default, not `--kv-unified`), llama.cpp gives every
sequence id its own buffer of ctx-per-session cells. The first `slots` streams decode: a step
batches the sessions of consecutive slots together (llama.cpp splits a batch where the
sequence ids have a gap), so they stay few and numbered from 0. With `--gpu-kv-budget`, the
streams the budget holds beyond them are docks: each parks one idle session's KV where it was
computed (device memory on a GPU), moved to and from a slot by a copy of the whole stream
inside that memory (`llama_memory_seq_cp` across streams), bit for bit, cells in place. One
more stream, the scratch, is kept empty: llama.cpp makes such a copy at the start of its next
decode, so a host read or write of a stream with a copy pending first decodes one token there.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvkeepd.errors import KvkeepError

# llama.cpp caps n_seq_max at 256 (LLAMA_MAX_SEQ).
MAX_STREAMS = 256
# Bytes per block of 32 values of each K/V type (ggml's block sizes).
_BLOCK_BYTES = {"f16": 64, "q8_0": 34, "q4_0": 18}


@dataclass(frozen=True)
class ModelShape:
    """What the size of a token's K and V rows depends on (read from the model)."""

    n_layer: int
    n_head_kv: int
    head_k: int
    head_v: int


def row_bytes(shape: ModelShape, kv_type: str) -> int:
    """Bytes of one token's K and V rows over all layers, in one stream."""
    per_block = _BLOCK_BYTES[kv_type]
    k, v = shape.n_head_kv * shape.head_k, shape.n_head_kv * shape.head_v
    return shape.n_layer * (-(-k // 32) + -(-v // 32)) * per_block


@dataclass(frozen=True)
class StreamPlan:
    """The context's streams: `slots` that decode (ids 0..slots-1), then `docks` that park
    idle sessions, then the scratch stream where there are docks. `stream_bytes`: the KV of
    one stream (0 where not computed)."""

    slots: int
    docks: int = 0
    stream_bytes: int = 0

    @property
    def scratch(self) -> int | None:
        """The id of the stream kept empty for applying pending copies (None: no docks)."""
        return self.slots + self.docks if self.docks else None

    @property
    def total(self) -> int:
        return self.slots + self.docks + (1 if self.docks else 0)

    def dock_id(self, place: int) -> int:
        """The sequence id of dock `place` (0-based)."""
        return self.slots + place


def plan(slots: int, stream_bytes: int, budget: int, *, unified: bool, recurrent: bool) -> StreamPlan:
    """The streams for `slots` decoding slots under a KV budget of `budget` bytes (0: no
    budget, just the slots). Docks need a stream per slot (not --kv-unified) and a memory that
    is KV only (a recurrent state lives in other buffers)."""
    if not budget:
        return StreamPlan(slots, 0, stream_bytes)
    if unified:
        raise KvkeepError("--gpu-kv-budget docks sessions in KV streams of their own: not with --kv-unified")
    fits = min(MAX_STREAMS, budget // max(stream_bytes, 1))
    if fits < slots:
        raise KvkeepError(
            f"--gpu-kv-budget {budget} holds {fits} KV streams of {stream_bytes} bytes (ctx-per-session "
            f"tokens each), fewer than --slots {slots}: raise the budget or lower --slots or "
            "--ctx-per-session"
        )
    docks = fits - slots - 1  # one stream is the scratch
    if docks < 1 or recurrent:
        return StreamPlan(slots, 0, stream_bytes)
    return StreamPlan(slots, docks, stream_bytes)
