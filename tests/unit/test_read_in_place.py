"""A restore from a file store reads each block straight into the blob llama.cpp takes
(storage/state_reads.py, state/pieces.py's `Scatter`): the blob is the one
assembling the pieces gives, byte for byte, for every layout, codec and length; a block that is
compressed is decoded on the way; a damaged, cut or grown block file is refused with
CorruptCheckpoint and removed, as the ordinary read does (no model, no daemon)."""

from __future__ import annotations

import itertools
import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvkeepd.errors import CorruptCheckpoint
from kvkeepd.state import pieces
from kvkeepd.state.cells import KvCells, SeqKv
from kvkeepd.state.layout import KvLayout, StateLayout
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage.blocks.local import LocalBlockStore
from kvkeepd.storage.catalog.sqlite import SqliteCatalog
from kvkeepd.storage.checkpoints import CheckpointStore
from kvkeepd.values.messages import ChatMessage
from kvkeepd.values.sampling import SamplingParams

BLOCK = 16
CODECS = ["none", "lz4", "zstd"]
N_VOCAB = 100
EXAMPLES = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@st.composite
def layouts(draw: st.DrawFn) -> StateLayout:
    """A plain KV layout (1-3 streams, 1-3 layers, V in rows: read in place), or one that is
    assembled (V transposed, or a sliding window beside the full section)."""
    n_layer = draw(st.integers(1, 3))
    k = tuple((draw(st.integers(0, 40)), draw(st.integers(1, 12))) for _ in range(n_layer))
    v_rows = tuple((draw(st.integers(0, 40)), draw(st.integers(1, 12)), 0) for _ in k)
    streams = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["plain", "plain", "v-trans", "window"]))
    if kind == "v-trans":
        v_trans = tuple((t, 2, draw(st.integers(1, 4))) for t, _, _ in v_rows)
        return StateLayout((KvLayout(streams, k, True, v_trans),))
    full = KvLayout(streams, k, False, v_rows)
    if kind == "window":
        return StateLayout((full, KvLayout(streams, k, False, v_rows, window=draw(st.integers(1, 5)))))
    return StateLayout((full,))


def state(layout: StateLayout, n: int, rng: random.Random, compressible: bool) -> SeqKv:
    """n positions of random bytes (or of few values, which lz4 and zstd shrink), in runs
    of any length."""
    sections = []
    for sec in layout.sections:
        assert isinstance(sec, KvLayout)
        p0 = sec.first(n)
        cuts = sorted(rng.sample(range(1, n - p0), min(2, n - p0 - 1))) if n - p0 > 1 else []
        runs = []
        for a, b in itertools.pairwise([0, *cuts, n - p0]):
            size = (b - a) * sec.cell_bytes
            data = (
                bytes(rng.choice(b"\x00\x01") for _ in range(size)) if compressible else rng.randbytes(size)
            )
            runs.append(pieces.piece(sec, data, b - a))
        sections.append(pieces.cells_from(sec, p0, runs))
    return pieces.build(layout, n, sections)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(N_VOCAB) for _ in range(n)]


def snapshot(tokens: list[int]) -> Snapshot:
    return Snapshot(
        session_id="s_0123456789ab",
        persistent=True,
        created_at=1.0,
        tokens=tokens,
        n_kv=0,
        logits=None,
        draws=0,
        params=SamplingParams(seed=1),
        stop=(),
        messages=[ChatMessage("user", "hello", 0)],
        fingerprint="f" * 64,
        kv_layout=None,
        block_tokens=BLOCK,
        label="in place",
    )


@contextmanager
def file_store(layout: StateLayout, codec: str) -> Iterator[CheckpointStore]:
    with tempfile.TemporaryDirectory() as root:
        catalog = SqliteCatalog(":memory:")
        try:
            yield CheckpointStore(
                catalog,
                LocalBlockStore(Path(root) / "blocks"),
                b"k" * 32,
                fingerprint="f" * 64,
                layout=layout,
                block_tokens=BLOCK,
                codec=codec,
                n_vocab=N_VOCAB,
            )
        finally:
            catalog.close()


def blob(kv: SeqKv) -> bytes:
    return bytes(pieces.assemble(kv))


@EXAMPLES
@given(
    layouts(),
    st.integers(1, 60),
    st.sampled_from(["none", "lz4", "zstd"]),
    st.booleans(),
    st.integers(0, 2**32),
)
def test_a_state_read_from_files_is_the_assembled_blob(
    layout: StateLayout, n: int, codec: str, compressible: bool, seed: int
) -> None:
    """Saved to files and loaded back, a state gives the blob assembling its pieces gives;
    a plain layout's comes read in place (a blob llama.cpp can take as it is)."""
    rng = random.Random(seed)
    kv = state(layout, n, rng, compressible)
    with file_store(layout, codec) as store:
        row, _ = store.save(
            snapshot([rng.randrange(N_VOCAB) for _ in range(n + 1)]), kv, kind="explicit", now=0.0
        )
        loaded = store.load(row.checkpoint_id, 0.0)
    assert loaded.kv is not None and not loaded.reprefill
    assert blob(loaded.kv) == blob(kv)
    if pieces.Scatter.fits(layout):
        assert loaded.kv.raw is not None
        assert all(isinstance(s, KvCells) and s.n == n for s in loaded.kv.sections)


PLAIN = StateLayout((KvLayout(2, ((1, 8), (1, 8)), False, ((1, 8, 0), (1, 8, 0))),))


@pytest.mark.parametrize("damage", ["bit", "cut", "grown", "header"])
def test_a_damaged_block_file_is_refused_and_removed(damage: str) -> None:
    """A block file changed under the store fails the load with CorruptCheckpoint and is
    removed, so that the next checkpoint of those tokens writes it again."""
    rng = random.Random(5)
    kv = state(PLAIN, 40, rng, compressible=False)
    with file_store(PLAIN, "none") as store:
        row, snap = store.save(snapshot(tokens(rng, 41)), kv, kind="explicit", now=0.0)
        key = snap.blocks[1]
        assert isinstance(store.store, LocalBlockStore)
        path = store.store.root / key[:2] / key
        data = bytearray(path.read_bytes())
        if damage == "bit":
            data[-3] ^= 0x10
        elif damage == "cut":
            del data[-5:]
        elif damage == "grown":
            data += b"\0"
        else:
            data[4] = 9  # no codec has that number
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptCheckpoint):
            store.load(row.checkpoint_id, 0.0)
        assert not store.store.has(key)
        assert store.store.has(snap.blocks[0])


def test_a_missing_block_is_refused_naming_it() -> None:
    rng = random.Random(6)
    kv = state(PLAIN, 20, rng, compressible=False)
    with file_store(PLAIN, "none") as store:
        row, snap = store.save(snapshot(tokens(rng, 21)), kv, kind="explicit", now=0.0)
        store.store.delete(snap.blocks[0])
        with pytest.raises(CorruptCheckpoint, match="missing"):
            store.load(row.checkpoint_id, 0.0)


def test_the_scatter_places_match_the_assembled_blob() -> None:
    """Each piece's places in the blob are where assembling puts its cells' rows."""
    rng = random.Random(7)
    kv = state(PLAIN, 37, rng, compressible=False)
    out = np.empty(pieces.Scatter.size(PLAIN, 37), dtype=np.uint8)
    scatter = pieces.Scatter(PLAIN, 37, out)
    (cells,) = kv.sections
    assert isinstance(cells, KvCells)
    for a in range(0, 37, BLOCK):
        b = min(a + BLOCK, 37)
        scatter.place(a, b, pieces.cut(cells, a, b))
    assert bytes(out) == blob(kv)
    assert blob(scatter.state()) == blob(kv)
    with pytest.raises(ValueError):
        scatter.regions(30, 38)
