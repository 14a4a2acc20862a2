"""Every loader of untrusted bytes refuses bad input with a typed error, in bounded time and
memory, and whatever it accepts keeps the promises its docstring makes (property-based, with
hypothesis; no model, no llama.cpp, no daemon).

- `manifest.decode`: valid manifests round-trip; with the MAC key every changed byte is
  refused; without it (imports) byte and JSON-field mutations, re-MAC'd, are refused with
  CorruptCheckpoint or IncompatibleCheckpoint, or decode to a snapshot whose every field has
  the type and range `decode` checks.
- `blocks.unframe`: frames of every codec round-trip; mutated and forged ones are refused
  with CorruptCheckpoint, never decoded to another payload, and never make it allocate much
  more than the block's size (lz4 and zstd bombs).
- `state.parse`, `parse_partial`, `discover`: states of hand-made layouts (plain, iSWA,
  hybrid, recurrent; cells in any order, in any stream) round-trip; mutated blobs are refused
  with StateFormatError or parse to cells that a naive reading of the blob agrees with, the
  full section at exactly 0..n-1, a window at exactly its last positions, a recurrent state
  at n-1.
- `exports.import_chunks`: valid exports import and load back equal; mutated ones (bytes
  and records, the final BLAKE2b recomputed so the inner checks are reached) are refused
  with a KvkeepError, or import into a checkpoint that loads and exports again.

Runs are derandomized (the same examples every run). KVKEEP_FUZZ_EXAMPLES=20000 runs that
many examples per property; KVKEEP_FUZZ_SEED=<int> a different, random stream of them.

Bugs these properties found are kept below as tests of their minimal inputs (the corpus):
a lone surrogate in a label, a salt of odd length, a timestamp beyond float range, zstd
frames that declare a huge content size.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import re
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import lz4.frame
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvkeepd.errors import CorruptCheckpoint, IncompatibleCheckpoint, KvkeepError
from kvkeepd.state import cells as kvstate
from kvkeepd.state import frames as blk
from kvkeepd.state import manifest as mf
from kvkeepd.state import pieces
from kvkeepd.state.cells import KvCells, RecurrentCells, SeqKv
from kvkeepd.state.layout import (
    MAX_ROW,
    SEQ_MAGIC,
    KvLayout,
    RecurrentLayout,
    StateFormatError,
    StateLayout,
)
from kvkeepd.state.manifest import Snapshot
from kvkeepd.storage import checkpoints as ckpt
from kvkeepd.storage import exports as kvexports
from kvkeepd.storage.blocks.memory import MemoryBlockStore
from kvkeepd.storage.catalog.sqlite import SqliteCatalog
from kvkeepd.storage.checkpoints import CheckpointStore
from kvkeepd.storage.exports import EXPORT_MAGIC
from kvkeepd.values.messages import ChatMessage
from kvkeepd.values.sampling import SamplingParams

# ---- run length ---------------------------------------------------------------------------

EXAMPLES = int(os.environ.get("KVKEEP_FUZZ_EXAMPLES", "0"))
SEED = os.environ.get("KVKEEP_FUZZ_SEED")
#: One call of a loader on these inputs (at most a few hundred KB) that takes longer than this
#: is a hang in the making (a loop that does not advance, a superlinear path).
SLOW_S = 2.0

# A hang fails the test instead of the CI job; long runs get the time they need.
pytestmark = pytest.mark.timeout(max(300, EXAMPLES // 10))

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def fuzz(examples: int) -> Callable[[F], F]:
    """Hypothesis settings of these properties: `examples` in CI (KVKEEP_FUZZ_EXAMPLES
    overrides), no deadline (the run length is bounded instead), derandomized unless
    KVKEEP_FUZZ_SEED is set, no example database in the working tree."""

    def wrap(test: F) -> F:
        test = settings(
            max_examples=EXAMPLES or examples,
            deadline=None,
            derandomize=SEED is None,
            database=None,
            print_blob=True,
            # The autouse daemon-invariant fixture of conftest.py is function-scoped; it checks
            # nothing here (no daemon runs) and may well run once per test, not per example.
            suppress_health_check=[
                HealthCheck.function_scoped_fixture,
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
            ],
        )(test)
        if SEED is not None:
            test = seed(int(SEED))(test)
        return test

    return wrap


# ---- typed errors ------------------------------------------------------------------------


def typed(call: Callable[[], T], allowed: type[BaseException] | tuple[type[BaseException], ...]) -> T | None:
    """The call's result, or None if it refused with an `allowed` error. Any other
    exception, or a call slower than SLOW_S, fails the property."""
    start = time.perf_counter()
    try:
        return call()
    except allowed:
        return None
    except Exception as e:
        raise AssertionError(f"untyped {type(e).__name__}: {e}") from e
    finally:
        took = time.perf_counter() - start
        assert took < SLOW_S, f"one call took {took:.1f} s"


# ---- byte mutations ------------------------------------------------------------------------

U32 = [0, 1, 2, 3, 7, 8, 12, 16, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 1 << 24, 0x7FFFFFFF, 0x80000000]
U32 += [0xFFFFFFFE, 0xFFFFFFFF]
U64 = [*U32, 1 << 32, 1 << 40, MAX_ROW - 1, MAX_ROW, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]

Field = tuple[int, int]  # (offset, width) of a header field of a blob


def mutate(data: st.DataObject, blob: bytes, fields_at: Sequence[Field] = (), max_ops: int = 4) -> bytes:
    """`blob` with 1..max_ops random edits: bit flips, byte sets, truncation, insertion,
    deletion, duplication, interesting u32/u64 values anywhere or over a known header field."""
    buf = bytearray(blob)
    for _ in range(data.draw(st.integers(1, max_ops), label="ops")):
        ops = ["flip", "byte", "truncate", "insert", "delete", "word", "dup", "zero", "append"]
        if fields_at:
            ops = ["field", "field", *ops]
        op = data.draw(st.sampled_from(ops), label="op")
        n = len(buf)
        if op == "field":
            at, width = data.draw(st.sampled_from(list(fields_at)), label="field")
            if at + width > n:
                continue
            value = data.draw(st.sampled_from(U64 if width == 8 else U32) | st.integers(0, 255), label="v")
            value += data.draw(st.sampled_from([0, 0, 1, -1]), label="off")
            buf[at : at + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
            continue
        if op == "append":
            buf += data.draw(st.binary(min_size=1, max_size=64), label="tail")
            continue
        if op == "insert":
            i = data.draw(st.integers(0, n), label="at")
            buf[i:i] = data.draw(st.binary(min_size=1, max_size=32), label="ins")
            continue
        if not n:
            continue
        i = data.draw(st.integers(0, n - 1), label="at")
        if op == "flip":
            buf[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "byte":
            buf[i] = data.draw(st.integers(0, 255), label="byte")
        elif op == "truncate":
            del buf[i:]
        elif op == "delete":
            del buf[i : i + data.draw(st.integers(1, 16), label="len")]
        elif op == "zero":
            j = i + data.draw(st.integers(1, 16), label="len")
            buf[i:j] = bytes(len(buf[i:j]))
        elif op == "dup":
            j = i + data.draw(st.integers(1, 32), label="len")
            k = data.draw(st.integers(0, n), label="to")
            buf[k:k] = buf[i:j]
        elif op == "word":
            width = data.draw(st.sampled_from([4, 8]), label="width")
            value = data.draw(st.sampled_from(U64 if width == 8 else U32), label="v")
            buf[i : i + width] = value.to_bytes(width, "little")
    return bytes(buf)


def rng_bytes(rng: random.Random, size: int, compressible: bool = False) -> bytes:
    """Random bytes; compressible ones are runs over a small alphabet."""
    if not compressible:
        return rng.randbytes(size)
    out = bytearray()
    while len(out) < size:
        out += bytes([rng.choice(b"\x00\x01\x3c\xff")]) * rng.randint(1, 24)
    return bytes(out[:size])


# ---- manifests -----------------------------------------------------------------------------

KEY = b"k" * 32
N_VOCAB = 100
hex_keys = st.binary(min_size=32, max_size=32).map(bytes.hex)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    """Any snapshot `encode` can write and `decode` must read back equal."""
    tokens = draw(st.lists(st.integers(0, N_VOCAB - 1), max_size=40))
    logits = None
    if draw(st.booleans()):
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        logits = (rng.standard_normal(N_VOCAB) * 10).astype(np.float32)
    floats = st.floats(allow_nan=False, allow_infinity=False)
    return Snapshot(
        session_id=draw(st.text(max_size=20)),
        persistent=draw(st.booleans()),
        created_at=draw(floats),
        saved_at=draw(floats),
        label=draw(st.text(max_size=20)),
        tokens=tokens,
        n_kv=draw(st.integers(0, len(tokens))),
        logits=logits,
        draws=draw(st.integers()),
        params=SamplingParams(
            temperature=draw(st.floats(0, 100)),
            top_k=draw(st.integers(0, 1_000_000)),
            top_p=draw(st.floats(0, 1, exclude_min=True)),
            min_p=draw(st.floats(0, 1)),
            repeat_penalty=draw(st.floats(0, 10, exclude_min=True)),
            penalty_last_n=draw(st.integers(-1, 1 << 20)),
            seed=draw(st.integers(0, 2**64 - 1)),
        ),
        stop=tuple(draw(st.lists(st.text(max_size=8), max_size=3))),
        messages=draw(
            st.lists(
                st.builds(
                    ChatMessage,
                    st.sampled_from(["system", "user", "assistant"]),
                    st.text(max_size=30),
                    st.integers(),
                ),
                max_size=3,
            )
        ),
        fingerprint=draw(st.text(max_size=64)),
        kv_layout=draw(st.none() | st.text(max_size=40)),
        block_tokens=draw(st.integers(1, 4096)),
        blocks=draw(st.lists(hex_keys, max_size=3)),
        window=draw(st.lists(st.tuples(hex_keys, st.integers(0, 1 << 40)), max_size=2)),
        recurrent=draw(st.just("") | hex_keys),
        salt=draw(st.binary(max_size=64).map(bytes.hex)),
        tenant=draw(st.text(max_size=40)),
        system_end=draw(st.integers(0, len(tokens))),
        context_policy=draw(st.sampled_from(["error", "truncate"])),
        truncations=draw(st.integers(0, 1 << 40)),
        dropped_tokens=draw(st.integers(0, 1 << 40)),
        forked_from=draw(st.sampled_from(["", "s_", "c_"]).map(lambda p: p and p + "0a" * 12)),
    )


def snapshot_fields(s: Snapshot) -> dict[str, Any]:
    """A snapshot as comparable values (logits as their bytes)."""
    out = {f.name: getattr(s, f.name) for f in fields(s)}
    out["logits"] = None if s.logits is None else np.asarray(s.logits, dtype="<f4").tobytes()
    return out


def check_snapshot(s: Snapshot) -> None:
    """What `decode` promises of a snapshot it returns: every field's type and range, and
    that it encodes to a manifest that decodes to the same snapshot."""
    assert s.format == mf.FORMAT
    assert all(type(t) is int and 0 <= t < N_VOCAB for t in s.tokens)
    assert type(s.n_kv) is int and 0 <= s.n_kv <= len(s.tokens)
    if s.logits is not None:
        assert s.logits.shape == (N_VOCAB,) and s.logits.dtype == np.float32
        assert np.all(np.isfinite(s.logits))
    s.params.validate()
    assert all(type(getattr(s.params, n)) is int for n in ("top_k", "penalty_last_n", "seed"))
    assert all(type(getattr(s.params, n)) is float for n in ("temperature", "top_p", "min_p"))
    for name in ("session_id", "label", "fingerprint", "recurrent", "salt", "tenant"):
        assert type(getattr(s, name)) is str, name
    assert type(s.persistent) is bool and type(s.draws) is int
    assert math.isfinite(s.created_at) and math.isfinite(s.saved_at)
    assert type(s.block_tokens) is int and 1 <= s.block_tokens <= 4096
    assert all(mf._is_key(b) for b in s.blocks)
    assert all(mf._is_key(k) and type(p) is int and p >= 0 for k, p in s.window)
    assert s.recurrent == "" or mf._is_key(s.recurrent)
    assert len(s.salt) <= 128 and all(c in "0123456789abcdef" for c in s.salt)
    assert len(s.tenant) <= 128
    assert s.kv_layout is None or type(s.kv_layout) is str
    assert all(isinstance(x, str) for x in s.stop)
    assert type(s.system_end) is int and 0 <= s.system_end <= len(s.tokens)
    assert s.context_policy in ("error", "truncate")
    assert all(type(n) is int and n >= 0 for n in (s.truncations, s.dropped_tokens))
    assert s.forked_from == "" or re.fullmatch(r"[sc]_[0-9a-f]{24}", s.forked_from)
    for m in s.messages:
        assert m.role in ("system", "user", "assistant")
        assert type(m.content) is str and type(m.start) is int
    again = mf.decode(mf.encode(s, KEY), KEY, N_VOCAB)
    assert snapshot_fields(again) == snapshot_fields(s)


@dataclass
class ManifestParts:
    """A manifest's sections, to edit one and join them again (with a fresh MAC)."""

    magic: bytes
    meta: Any
    raw_head: bytes | None  # overrides the JSON of `meta` when set
    n_tokens: int
    tokens: bytes
    n_logits: int
    logits: bytes
    tail: bytes = b""

    @classmethod
    def of(cls, data: bytes) -> ManifestParts:
        at = len(mf.MAGIC)
        (n,) = struct.unpack_from("<I", data, at)
        head = data[at + 4 : at + 4 + n]
        at += 4 + n
        (nt,) = struct.unpack_from("<I", data, at)
        tokens = data[at + 4 : at + 4 + 4 * nt]
        at += 4 + 4 * nt
        (nl,) = struct.unpack_from("<I", data, at)
        logits = data[at + 4 : at + 4 + 4 * nl]
        return cls(data[: len(mf.MAGIC)], json.loads(head), None, nt, tokens, nl, logits)

    def join(self, key: bytes = KEY) -> bytes:
        head = self.raw_head if self.raw_head is not None else json_with_raw(self.meta)
        body = b"".join(
            [
                self.magic,
                struct.pack("<I", len(head)),
                head,
                struct.pack("<I", self.n_tokens),
                self.tokens,
                struct.pack("<I", self.n_logits),
                self.logits,
                self.tail,
            ]
        )
        return body + mf.mac(key, body)


@dataclass(frozen=True)
class Raw:
    """JSON text put as it is where a value goes (what json.dumps cannot write)."""

    text: str


RAW_JSON = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-1e999",
    "1" + "0" * 400,  # an integer no float can hold
    "-" + "9" * 400,
    "1" + "0" * 5000,  # beyond Python's int-from-string digit limit
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 50_000 + "1" + "}" * 50_000,
    '"\\ud800"',
    '"\\udfff\\ud800x"',
    '"' + "x" * 300_000 + '"',
    "1.7976931348623157e308",
    "5e-324",
    "-0",
    "-0.0",
    "18446744073709551616",
    "9223372036854775808",
    '"abc"',
    '"' + "0" * 63 + '"',
    '"' + "A" * 64 + '"',
    '"' + "0" * 129 + '"',
    "[[]]",
    '[["' + "0" * 64 + '", -1]]',
    '[["' + "0" * 64 + '", 1.0]]',
    '[["' + "0" * 64 + '", true]]',
    '[["' + "0" * 64 + '"]]',
    '[{"role": "user", "content": "x", "start": true}]',
    '[{"role": "tool", "content": "x", "start": 0}]',
    "{}",
    "null",
    "true",
]

#: Values of every wrong type and edge of range, for any field.
NASTY: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    16,
    4096,
    4097,
    1 << 31,
    1 << 32,
    1 << 62,
    1 << 63,
    1 << 64,
    -(1 << 63),
    10**30,
    10**400,
    -(10**400),
    0.0,
    -0.0,
    0.5,
    1.5,
    100.5,
    1e308,
    -1e308,
    5e-324,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "x",
    "user",
    "0" * 64,
    "f" * 128,
    "f" * 129,
    "a",
    "abc",
    "g" * 64,
    "\ud800",
    [],
    [None],
    ["0" * 64],
    [["0" * 64, 0]],
    {},
    {"role": "user", "content": "", "start": 0},
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
new_values = st.sampled_from(NASTY) | st.sampled_from(RAW_JSON).map(Raw) | json_values


def json_with_raw(value: Any) -> bytes:
    """json.dumps of `value`, with every Raw in it written as its text."""
    raws: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), separators=(",", ":"))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw, 1)
    return text.encode("utf-8", "surrogatepass")


def paths(value: Any, at: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """The path of every node of a JSON value (the root included)."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*at, i))


def edit_json(data: st.DataObject, meta: Any) -> Any:
    """`meta` with 1-3 nodes replaced, removed, or given a new sibling."""
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        every = list(paths(meta))
        top = [p for p in every if len(p) == 1]  # a manifest's own fields, half of the time
        pick_top = bool(top) and data.draw(st.booleans(), label="top")
        path = data.draw(st.sampled_from(top if pick_top else every), label="path")
        op = data.draw(st.sampled_from(["set", "set", "delete", "add"]), label="json-op")
        value = data.draw(new_values, label="value")
        if not path:
            meta = value if op == "set" else meta
            continue
        parent = meta
        for p in path[:-1]:
            parent = parent[p]
        last = path[-1]
        if op == "set":
            parent[last] = value
        elif op == "delete":
            del parent[last]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8), label="key")] = value
        else:
            parent.append(value)
    return meta


def edit_manifest(data: st.DataObject, valid: bytes) -> bytes:
    """A manifest with its JSON or binary sections edited, MAC'd again with KEY."""
    parts = ManifestParts.of(valid)
    op = data.draw(st.sampled_from(["json", "json", "json", "head", "tokens", "logits", "counts", "magic"]))
    if op == "json":
        parts.meta = edit_json(data, parts.meta)
    elif op == "head":  # the metadata's bytes: other encodings, a BOM, not UTF-8, not JSON
        text = json.dumps(parts.meta)
        parts.raw_head = data.draw(
            st.sampled_from(
                [
                    b"",
                    text.encode("utf-16"),
                    text.encode("utf-32-le"),
                    b"\xef\xbb\xbf" + text.encode(),
                    text.encode()[:-1],
                    text.encode() + b"\xff",
                    b"\xc3\x28",
                ]
            )
            | st.binary(max_size=64)
        )
    elif op == "tokens" and parts.n_tokens:
        i = data.draw(st.integers(0, parts.n_tokens - 1))
        value = data.draw(st.sampled_from([-1, N_VOCAB, N_VOCAB - 1, -(1 << 31), (1 << 31) - 1]))
        tokens = bytearray(parts.tokens)
        struct.pack_into("<i", tokens, 4 * i, value)
        parts.tokens = bytes(tokens)
    elif op == "logits" and parts.n_logits:
        i = data.draw(st.integers(0, parts.n_logits - 1))
        logit = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -0.0]))
        logits = bytearray(parts.logits)
        struct.pack_into("<f", logits, 4 * i, logit)
        parts.logits = bytes(logits)
    elif op == "counts":
        which = data.draw(st.sampled_from(["tokens", "logits", "tail"]))
        delta = data.draw(st.sampled_from([-1, 1, N_VOCAB, -N_VOCAB]))
        if which == "tokens":
            parts.n_tokens = max(0, parts.n_tokens + delta)
            parts.tokens = parts.tokens[: 4 * parts.n_tokens].ljust(4 * parts.n_tokens, b"\x00")
        elif which == "logits":
            parts.n_logits = max(0, parts.n_logits + delta)
            parts.logits = parts.logits[: 4 * parts.n_logits].ljust(4 * parts.n_logits, b"\x00")
        else:
            parts.tail = b"\x00" * abs(delta)
    elif op == "magic":
        parts.magic = data.draw(st.sampled_from([b"KVSTMAN2", b"KVSTMAN0", b"kvstman1", b"KVKPEXP1"]))
    return parts.join()


def decodes_or_refuses(blob: bytes, key: bytes | None) -> Snapshot | None:
    return typed(lambda: mf.decode(blob, key, N_VOCAB), (CorruptCheckpoint, IncompatibleCheckpoint))


@fuzz(150)
@given(snapshots())
def test_manifests_round_trip(snap: Snapshot) -> None:
    """decode(encode(s)) == s, with the MAC key and without."""
    data = mf.encode(snap, KEY)
    for key in (KEY, None):
        assert snapshot_fields(mf.decode(data, key, N_VOCAB)) == snapshot_fields(snap)


@fuzz(250)
@given(snapshots(), st.data())
def test_with_its_key_every_changed_manifest_is_refused(snap: Snapshot, data: st.DataObject) -> None:
    """Any change to a manifest's bytes is refused under its MAC key (typed), and without
    the key it is refused (typed) or decodes to a snapshot that keeps decode's promises."""
    valid = mf.encode(snap, KEY)
    bad = mutate(data, valid, [(8, 4)])
    if bad != valid:
        assert decodes_or_refuses(bad, KEY) is None
    found = decodes_or_refuses(bad, None)
    if found is not None:
        check_snapshot(found)


@fuzz(300)
@given(snapshots(), st.data())
def test_edited_manifests_are_refused_with_typed_errors(snap: Snapshot, data: st.DataObject) -> None:
    """JSON fields of every wrong type and value (huge numbers, NaN/inf, deep nesting, very
    long strings, lone surrogates), token ids outside the vocabulary, non-finite logits and
    wrong counts, re-MAC'd: refused with CorruptCheckpoint or IncompatibleCheckpoint (with
    the key and without), or decoded to a snapshot that keeps decode's promises."""
    bad = edit_manifest(data, mf.encode(snap, KEY))
    for key in (KEY, None):
        found = decodes_or_refuses(bad, key)
        if found is not None:
            check_snapshot(found)


RICH = Snapshot(
    session_id="s_1",
    persistent=True,
    created_at=1.5,
    saved_at=2.5,
    label="a label",
    tokens=[1, 2, 3, 99, 0],
    n_kv=4,
    logits=np.linspace(-5, 5, N_VOCAB, dtype=np.float32),
    draws=7,
    params=SamplingParams(seed=5),
    stop=("\n\n", "END"),
    messages=[ChatMessage("system", "be brief", 0), ChatMessage("user", "hi", 2)],
    fingerprint="f" * 64,
    kv_layout="llama.cpp-seq-state-2;kv(...)",
    block_tokens=16,
    blocks=["a" * 64],
    window=[("b" * 64, 3)],
    recurrent="c" * 64,
    salt="0123abcd",
    tenant="t",
    system_end=2,
    context_policy="truncate",
    truncations=3,
    dropped_tokens=120,
    forked_from="c_" + "0123456789ab" * 2,
)


def test_every_manifest_field_with_every_wrong_value_is_refused_with_typed_errors() -> None:
    """Exhaustively, every node of a manifest's JSON (fields, sampling parameters, messages,
    window pieces) set to every value of NASTY and RAW_JSON, or removed, with the key and
    without: refused with a typed error or decoded to a snapshot that keeps decode's promises.
    (Hypothesis combines edits; this grid makes sure each single one is tried.)"""
    valid = mf.encode(RICH, KEY)
    meta = ManifestParts.of(valid).meta
    tried = 0
    for path in paths(meta):
        for value in [*NASTY, *map(Raw, RAW_JSON), "delete"]:
            parts = ManifestParts.of(valid)
            if not path:
                if value == "delete":
                    continue
                parts.meta = value
            else:
                parent = parts.meta
                for p in path[:-1]:
                    parent = parent[p]
                if value == "delete":
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = value
            bad = parts.join()
            for key in (KEY, None):
                found = decodes_or_refuses(bad, key)
                if found is not None:
                    check_snapshot(found)
                tried += 1
    assert tried > 5000


# ---- block frames --------------------------------------------------------------------------


def unframes_or_refuses(frame: bytes, expect_len: int) -> bytes | None:
    """unframe's payload, or None if refused with CorruptCheckpoint; its allocations (the
    peak traced while it runs) stay within a few times the frame and the block."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = typed(lambda: blk.unframe(frame, expect_len), CorruptCheckpoint)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = 2 * len(frame) + 4 * expect_len + (1 << 20)
    assert peak <= bound, f"unframe of {len(frame)} bytes allocated {peak} bytes"
    return None if out is None else bytes(out)


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    """Block payloads: empty, random or compressible, up to 8 KiB."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    size = draw(st.sampled_from([0, 1, 2, 3, 16, 255, 1024, 4096, 8191]) | st.integers(0, 8192))
    return rng_bytes(rng, size, compressible=draw(st.booleans()))


codecs = st.sampled_from(sorted(blk.CODECS))
FRAME_FIELDS: list[Field] = [(0, 4), (4, 1), (5, 4), (9, 4), (13, 4), (17, 4)]


@fuzz(150)
@given(payloads(), codecs)
def test_frames_round_trip(payload: bytes, codec: str) -> None:
    """unframe(frame(p, codec), len(p)) == p for every codec."""
    assert unframes_or_refuses(blk.frame(payload, codec), len(payload)) == payload


@fuzz(400)
@given(payloads(), codecs, st.data())
def test_mutated_frames_are_refused_or_give_their_payload(
    payload: bytes, codec: str, data: st.DataObject
) -> None:
    """A mutated frame is refused with CorruptCheckpoint, or gives a payload of exactly the
    expected length and the header's checksum (for the raw codec, with the checksum fixed
    up, whatever bytes it holds); never more allocation than the bound of unframes_or_refuses."""
    valid = blk.frame(payload, codec)
    bad = mutate(data, valid, FRAME_FIELDS)
    fix_crc = len(bad) >= 13 and bad[4] == 0 and data.draw(st.booleans(), label="fix crc")
    if fix_crc:
        bad = bad[:9] + struct.pack("<I", zlib.crc32(bad[13:])) + bad[13:]
    expect = data.draw(st.sampled_from([len(payload), len(payload) + 1, max(0, len(payload) - 1)]))
    out = unframes_or_refuses(bad, expect)
    if out is not None:
        _, _, length, crc = struct.unpack_from("<4sBII", bad)
        assert len(out) == length == expect and zlib.crc32(out) == crc
        if bad[4] == 0:
            assert out == bad[13:]


def zstd_raw_frame(content: bytes, declared: int) -> bytes:
    """A zstd frame of one raw block holding `content` (up to 128 KiB), whose header
    declares a content size of `declared` bytes (and a 128 KiB window)."""
    block = (1 | len(content) << 3).to_bytes(3, "little")  # last block, raw, its size
    return b"\x28\xb5\x2f\xfd" + bytes([0xC0, 0x38]) + struct.pack("<Q", declared) + block + content


@st.composite
def forged_frames(draw: st.DrawFn) -> tuple[bytes, bytes, int]:
    """(frame, the payload its header names, expect_len): a frame of any codec with any of
    its options, whose body encodes either that payload or another one (longer, shorter,
    changed), under a header with the right checksum."""
    payload = draw(payloads())
    kind = draw(st.sampled_from(["same", "longer", "shorter", "changed", "twice"]))
    inner = payload
    if kind == "longer":
        inner = payload + draw(st.binary(min_size=1, max_size=64))
    elif kind == "shorter":
        inner = payload[: draw(st.integers(0, max(0, len(payload) - 1)))]
    elif kind == "changed" and payload:
        i = draw(st.integers(0, len(payload) - 1))
        inner = payload[:i] + bytes([payload[i] ^ 1]) + payload[i + 1 :]
    code = draw(st.sampled_from([1, 2, 3]))
    if code == 3:  # zstd, written by hand: a raw block under any declared content size
        shuffled = blk._shuffle(inner, 2)
        declared = draw(st.sampled_from([len(shuffled), len(shuffled) + 1, 1 << 20, 1 << 32, 1 << 62]))
        body, code = zstd_raw_frame(shuffled, declared), 2
    elif code == 1:
        body = lz4.frame.compress(
            inner,
            block_size=draw(st.sampled_from([0, 4, 5, 6, 7])),
            block_linked=draw(st.booleans()),
            content_checksum=draw(st.booleans()),
            block_checksum=draw(st.booleans()),
            store_size=draw(st.booleans()),
        )
        if kind == "twice":
            body += body
    else:
        cctx = zstandard.ZstdCompressor(
            level=draw(st.integers(-5, 5)),
            write_checksum=draw(st.booleans()),
            write_content_size=draw(st.booleans()),
        )
        body = cctx.compress(blk._shuffle(inner, 2))
        if kind == "twice":
            body += body
    return (
        struct.pack("<4sBII", blk.MAGIC, code, len(payload), zlib.crc32(payload)) + body,
        payload,
        len(payload),
    )


@fuzz(300)
@given(forged_frames())
def test_forged_frames_give_their_payload_or_are_refused(forged: tuple[bytes, bytes, int]) -> None:
    """Frames made by the codecs with every option, or with another payload inside than
    their header names: the payload the header names, or CorruptCheckpoint."""
    frame, payload, expect = forged
    out = unframes_or_refuses(frame, expect)
    assert out is None or out == payload


BOMB = 64 << 20  # bytes of zeros inside each bomb


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """Frames of a 64-byte block whose bodies expand to 64 MiB of zeros (made once)."""
    zeros = bytes(BOMB)
    bodies = {
        "lz4": lz4.frame.compress(zeros, store_size=False),
        "lz4-sized": lz4.frame.compress(zeros, store_size=True),
        "zstd": zstandard.ZstdCompressor(level=3, write_content_size=False).compress(zeros),
    }
    codes = {"lz4": 1, "lz4-sized": 1, "zstd": 2}
    return {
        name: struct.pack("<4sBII", blk.MAGIC, codes[name], 64, zlib.crc32(bytes(64))) + body
        for name, body in bodies.items()
    }


@fuzz(30)
@given(st.sampled_from(["lz4", "lz4-sized", "zstd"]), st.sampled_from([0, 1, 64, 4096, 65536]))
def test_compression_bombs_are_refused_without_expanding(
    bombs: dict[str, bytes], name: str, expect: int
) -> None:
    """A frame whose body expands to 64 MiB, whatever block size it claims, is refused with
    CorruptCheckpoint while allocating at most a few times the frame and the block."""
    frame = bytearray(bombs[name])
    struct.pack_into("<I", frame, 5, expect)
    assert unframes_or_refuses(bytes(frame), expect) is None


# ---- sequence states -----------------------------------------------------------------------

#: The layouts of the model families, by hand: 2 layers of 8-byte K rows and transposed V
#: (2-byte elements, 4 of them); with a 3-position sliding window; with a recurrent state
#: (one empty S row, as LFM2's short convolutions have); recurrent alone.
FULL = KvLayout(1, ((1, 8), (1, 8)), True, ((1, 2, 4), (1, 2, 4)))
NAMED = {
    "kv": StateLayout((FULL,)),
    "iswa": StateLayout((FULL, KvLayout(1, ((1, 8), (1, 8)), False, ((1, 6, 0), (1, 6, 0)), window=3))),
    "hybrid": StateLayout((FULL, RecurrentLayout(2, ((0, 12), (0, 0), (0, 20), (0, 4))))),
    "recurrent": StateLayout((RecurrentLayout(1, ((0, 16), (0, 8))),)),
}


@st.composite
def kv_layouts(draw: st.DrawFn, window: int = 0) -> KvLayout:
    """A KV section of 1-3 streams and 1-3 layers, V transposed or not, small rows; every
    layer alike (as in most models) or not."""
    n_layer = draw(st.integers(1, 3))
    v_trans = draw(st.booleans())
    types = st.integers(0, 40)
    k = tuple((draw(types), draw(st.integers(1, 12))) for _ in range(n_layer))
    if v_trans:
        v = tuple((draw(types), draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 5))) for _ in k)
    else:
        v = tuple((draw(types), draw(st.integers(1, 12)), 0) for _ in k)
    if draw(st.booleans()):  # layers alike
        k = tuple((t, k[0][1]) for t, _ in k)
        v = tuple((t, v[0][1], v[0][2]) for t, _, _ in v)
    return KvLayout(draw(st.integers(1, 3)), k, v_trans, v, window)


@st.composite
def recurrent_layouts(draw: st.DrawFn) -> RecurrentLayout:
    """A recurrent section of 1-4 row sets, empty ones included."""
    rows = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 24)), min_size=1, max_size=4))
    return RecurrentLayout(draw(st.integers(1, 4)), tuple(rows))


@st.composite
def state_layouts(draw: st.DrawFn) -> StateLayout:
    """One of NAMED, or a random layout of each kind: kv, iswa, hybrid, hybrid-iswa,
    recurrent (1-3 streams, 1-3 layers, transposed V or not, windows of 1-5)."""
    if draw(st.booleans()):
        return NAMED[draw(st.sampled_from(sorted(NAMED)))]
    kind = draw(st.sampled_from(["kv", "iswa", "hybrid", "hybrid-iswa", "recurrent"]))
    if kind == "recurrent":
        return StateLayout((draw(recurrent_layouts()),))
    sections: list[KvLayout | RecurrentLayout] = [draw(kv_layouts())]
    if kind.endswith("iswa"):
        sections.append(draw(kv_layouts(window=draw(st.integers(1, 5)))))
    if kind.startswith("hybrid"):
        sections.append(draw(recurrent_layouts()))
    return StateLayout(tuple(sections))


def make_state(layout: StateLayout, n: int, rng: random.Random) -> SeqKv:
    """A state of n positions of random bytes, built from pieces as a load does (KV cells
    in 1-3 runs, or in runs of one size as blocks are)."""
    sections: list[KvCells | RecurrentCells] = []
    for sec in layout.sections:
        if isinstance(sec, RecurrentLayout):
            sections.append(pieces.recurrent_from(sec, n - 1, rng.randbytes(sec.nbytes) if n else b""))
            continue
        p0 = sec.first(n)
        if n - p0 <= 1:
            cuts = []
        elif rng.random() < 0.5:  # runs of one size, the last one shorter or not
            size = rng.randint(1, n - p0)
            cuts = list(range(size, n - p0, size))
        else:
            cuts = sorted(rng.sample(range(1, n - p0), min(rng.randint(0, 2), n - p0 - 1)))
        bounds = [0, *cuts, n - p0] if n > p0 else [0]
        runs = [
            pieces.piece(sec, rng.randbytes((b - a) * sec.cell_bytes), b - a)
            for a, b in itertools.pairwise(bounds)
        ]
        sections.append(pieces.cells_from(sec, p0, runs))
    return pieces.build(layout, n, sections)


@st.composite
def states(draw: st.DrawFn) -> SeqKv:
    """A state of 0-20 positions of any layout."""
    return make_state(
        draw(state_layouts()), draw(st.integers(0, 20)), random.Random(draw(st.integers(0, 2**32 - 1)))
    )


class BlobWriter:
    """Bytes in llama.cpp's state format, with the offset and width of every header field."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.fields: list[Field] = []

    def put(self, fmt: str, value: int) -> None:
        self.fields.append((len(self.buf), struct.calcsize(fmt)))
        self.buf += struct.pack(fmt, value)


def kv_arrays(s: KvCells) -> tuple[list[kvstate.Bytes], list[kvstate.Bytes]]:
    """A KV section's K and V per layer, its runs joined."""
    axis = 1 if s.layout.v_trans else 0
    ks = [np.concatenate([run[1][i] for run in s.runs]) for i in range(s.layout.n_layer)]
    vs = [np.concatenate([run[2][i] for run in s.runs], axis=axis) for i in range(s.layout.n_layer)]
    return ks, vs


def write_state(
    kv: SeqKv, rng: random.Random | None = None, partial: bool = False
) -> tuple[bytes, list[Field]]:
    """The blob llama.cpp writes of this state: only the cells each section holds (a window
    only its window), with `rng`, cells in a random order in a random stream. `partial`:
    the sliding-window and recurrent sections alone, as
    llama_state_seq_get_data_ext(..., PARTIAL_ONLY) writes them."""
    w = BlobWriter()
    w.put("<I", SEQ_MAGIC)
    w.put("<i", rng.randint(0, 3) if rng else 0)
    for s in kv.sections:
        if isinstance(s, RecurrentCells):
            if s.pos >= 0:
                w.put("<I", 1)
                w.put("<i", s.pos)
                w.put("<I", 0)
            else:
                w.put("<I", 0)
            w.put("<I", 0)
            w.put("<I", s.layout.n_layer)
            used = 0
            for t, row in s.layout.rows:
                w.put("<i", t)
                w.put("<Q", row)
                if s.pos >= 0:
                    w.buf += bytes(s.data[used : used + row])
                    used += row
            continue
        if partial and not s.layout.window:
            continue
        lay = s.layout
        w.put("<I", lay.n_stream)
        stream = rng.randrange(lay.n_stream) if rng else 0
        for i in range(lay.n_stream):
            if i != stream or not s.n:
                w.put("<I", 0)
                continue
            w.put("<I", s.n)
            order = list(range(s.n))
            if rng:
                rng.shuffle(order)
            for j in order:
                w.put("<i", s.p0 + j)
                w.put("<I", 1)
                w.put("<i", 0)
            w.put("<I", int(lay.v_trans))
            w.put("<I", lay.n_layer)
            ks, vs = kv_arrays(s)
            for (t, row), k in zip(lay.k, ks, strict=True):
                w.put("<i", t)
                w.put("<Q", row)
                w.buf += k[order].tobytes()
            for (t, a, b), v in zip(lay.v, vs, strict=True):
                w.put("<i", t)
                if lay.v_trans:
                    w.put("<I", a)
                    w.put("<I", b)
                    w.buf += v[:, order].tobytes()
                else:
                    w.put("<Q", a)
                    w.buf += v[order].tobytes()
    return bytes(w.buf), w.fields


def read_naively(blob: bytes, layout: StateLayout) -> list[dict[int, bytes] | tuple[int, bytes]]:
    """What a blob that parsed holds, read the obvious way: per KV section, each cell's bytes
    (K of every layer, then V) by its position; per recurrent section, (pos, rows)."""
    at = 8

    def u32() -> int:
        nonlocal at
        at += 4
        return int(struct.unpack_from("<I", blob, at - 4)[0])

    out: list[dict[int, bytes] | tuple[int, bytes]] = []
    for sec in layout.sections:
        if isinstance(sec, RecurrentLayout):
            count = u32()
            pos = -1
            if count:
                pos = struct.unpack_from("<i", blob, at)[0]
                at += 8
            at += 8
            data = b""
            for _, row in sec.rows:
                at += 12
                data += blob[at : at + row * count]
                at += row * count
            out.append((pos, data))
            continue
        cells: dict[int, bytes] = {}
        for _ in range(u32()):
            count = u32()
            if not count:
                continue
            positions = [struct.unpack_from("<i", blob, at + 12 * j)[0] for j in range(count)]
            at += 12 * count + 8
            parts: list[list[bytes]] = [[] for _ in range(count)]
            for _, row in sec.k:
                at += 12
                for j in range(count):
                    parts[j].append(blob[at + j * row : at + (j + 1) * row])
                at += count * row
            for _, a, b in sec.v:
                at += 12
                if sec.v_trans:
                    v = np.frombuffer(blob, np.uint8, count * a * b, at).reshape(b, count, a)
                    for j in range(count):
                        parts[j].append(v[:, j].tobytes())
                    at += count * a * b
                else:
                    for j in range(count):
                        parts[j].append(blob[at + j * a : at + (j + 1) * a])
                    at += count * a
            cells = {p: b"".join(x) for p, x in zip(positions, parts, strict=True)}
        out.append(cells)
    assert at == len(blob)
    return out


def content(kv: SeqKv) -> list[tuple[int, int, bytes]]:
    """A state's sections as comparable values: (first position, count, bytes)."""
    out = []
    for s in kv.sections:
        if isinstance(s, RecurrentCells):
            out.append((s.pos, -1, bytes(s.data)))
        else:
            out.append((s.p0, s.n, pieces.cut(s, s.p0, s.p0 + s.n) if s.n else b""))
    return out


def check_state(kv: SeqKv, layout: StateLayout, blob: bytes) -> None:
    """What `parse` promises of a state it returns, and that it is what the blob holds."""
    assert kv.layout == layout and len(kv.sections) == len(layout.sections)
    for s, sec in zip(kv.sections, layout.sections, strict=True):
        assert s.layout == sec
        if isinstance(s, RecurrentCells):
            assert isinstance(sec, RecurrentLayout) and s.pos == kv.n - 1
            assert len(s.data) == (sec.nbytes if s.pos >= 0 else 0)
            continue
        assert isinstance(sec, KvLayout)
        assert sum(run[0] for run in s.runs) == s.n
        if sec.window:  # exactly the last positions of the window
            assert (s.p0, s.p0 + s.n) == ((sec.first(kv.n), kv.n) if kv.n else (0, 0))
        else:  # exactly 0..n-1
            assert (s.p0, s.n) == (0, kv.n)
    assert kv.raw is None or bytes(kv.raw) == blob
    for s, naive in zip(kv.sections, read_naively(blob, layout), strict=True):
        if isinstance(s, RecurrentCells):
            assert naive == (s.pos, bytes(s.data))
        else:
            assert isinstance(naive, dict)
            assert sorted(naive) == list(range(s.p0, s.p0 + s.n))
            assert all(pieces.cut(s, p, p + 1) == naive[p] for p in naive)
            if s.n:  # a cut read back as a piece holds the same cells
                whole = pieces.cells_from(
                    s.layout, s.p0, [pieces.piece(s.layout, pieces.cut(s, s.p0, s.p0 + s.n), s.n)]
                )
                assert all(pieces.cut(whole, p, p + 1) == naive[p] for p in naive)
    # What was parsed writes and parses back to itself, in llama.cpp's form and assembled.
    again, _ = write_state(kv)
    assert content(kvstate.parse(again, layout)) == content(kv)
    if kv.window_from == 0:
        assert content(kvstate.parse(bytes(pieces.assemble(kv)), layout)) == content(kv)


def parses_or_refuses(blob: bytes, layout: StateLayout) -> SeqKv | None:
    return typed(lambda: kvstate.parse(blob, layout), StateFormatError)


def discover_flags(layout: StateLayout) -> dict[str, Any]:
    win = layout.windowed
    return {
        "recurrent": layout.kind == "recurrent",
        "hybrid": layout.kind.startswith("hybrid"),
        "window": win.window if win else 0,
    }


@fuzz(200)
@given(states(), st.integers(0, 2**32 - 1))
def test_states_round_trip(kv: SeqKv, order: int) -> None:
    """A state written as llama.cpp does (cells in any order, in any stream) parses back to
    itself; so does its assembled blob (no window above 0); its one-position probe
    discovers its layout."""
    blob, _ = write_state(kv, random.Random(order))
    parsed = kvstate.parse(blob, kv.layout)
    assert parsed.n == kv.n and content(parsed) == content(kv)
    check_state(parsed, kv.layout, blob)
    if kv.window_from == 0:
        assert content(kvstate.parse(bytes(pieces.assemble(kv)), kv.layout)) == content(kv)
    probe, _ = write_state(make_state(kv.layout, 1, random.Random(order)), random.Random(order))
    assert kvstate.discover(probe, **discover_flags(kv.layout)) == kv.layout
    if kv.layout.partial:
        partial, _ = write_state(kv, random.Random(order), partial=True)
        found = kvstate.parse_partial(partial, kv.layout, kv.n)
        sections = zip(content(kv), kv.layout.sections, strict=True)
        wanted = [c for c, sec in sections if sec in kv.layout.partial]
        assert content(SeqKv(StateLayout(kv.layout.partial), kv.n, found)) == wanted


@fuzz(600)
@given(states(), st.integers(0, 2**32 - 1), st.data())
def test_mutated_states_are_refused_or_parse_to_what_they_hold(
    kv: SeqKv, order: int, data: st.DataObject
) -> None:
    """A mutated state blob (any byte; counts, positions, sequence ids, row sizes and layer
    headers set to edge values) is refused with StateFormatError, or parses to a state
    that keeps parse's promises and holds what the blob holds."""
    blob, fields_at = write_state(kv, random.Random(order))
    bad = mutate(data, blob, fields_at)
    found = parses_or_refuses(bad, kv.layout)
    if found is not None:
        check_state(found, kv.layout, bad)


@fuzz(200)
@given(states(), state_layouts(), st.integers(0, 2**32 - 1))
def test_states_of_another_layout_are_refused(kv: SeqKv, other: StateLayout, order: int) -> None:
    """A state parsed against another layout is refused with StateFormatError, or parses
    to a state that keeps parse's promises under that layout."""
    blob, _ = write_state(kv, random.Random(order))
    found = parses_or_refuses(blob, other)
    if found is not None:
        check_state(found, other, blob)


@fuzz(300)
@given(state_layouts(), st.integers(0, 2**32 - 1), st.data())
def test_mutated_probes_discover_a_layout_that_parses_them_or_none(
    layout: StateLayout, order: int, data: st.DataObject
) -> None:
    """discover() on a mutated one-position probe, with the flags of its model or others:
    StateFormatError, or a layout of the kind the flags say, every row within bounds, that
    parses the probe (to a state that keeps parse's promises)."""
    probe, fields_at = write_state(make_state(layout, 1, random.Random(order)), random.Random(order))
    bad = mutate(data, probe, fields_at) if data.draw(st.booleans()) else probe
    flags = discover_flags(layout)
    if data.draw(st.booleans()):
        flags = {
            "recurrent": data.draw(st.booleans()),
            "hybrid": data.draw(st.booleans()),
            "window": data.draw(st.integers(0, 6)),
        }
    found = typed(lambda: kvstate.discover(bad, **flags), StateFormatError)
    if found is None:
        return
    kinds = {"recurrent": ["recurrent"], "hybrid": ["hybrid", "hybrid-iswa"]}
    want = (
        kinds["recurrent"] if flags["recurrent"] else kinds["hybrid"] if flags["hybrid"] else ["kv", "iswa"]
    )
    assert found.kind in want
    for sec in found.sections:
        if isinstance(sec, KvLayout):
            assert 1 <= sec.n_stream <= 256 and 1 <= sec.n_layer <= 4096
            assert all(0 < row < MAX_ROW for _, row in sec.k)
            assert all(0 < sec.v_row(i) < MAX_ROW for i in range(sec.n_layer))
            assert sec.window in (0, flags["window"])
        else:
            assert 1 <= sec.n_layer <= 4096 and sec.rows and all(0 <= r < MAX_ROW for _, r in sec.rows)
    check_state(kvstate.parse(bad, found), found, bad)


@fuzz(250)
@given(states(), st.data())
def test_mutated_partial_states_are_refused_or_parse(kv: SeqKv, data: st.DataObject) -> None:
    """parse_partial on a mutated partial blob (sliding windows and recurrent states):
    StateFormatError, or sections that a naive reading of the blob agrees with, each window
    at exactly its last positions of n and each recurrent state at n - 1."""
    if not kv.layout.partial:
        return
    blob, fields_at = write_state(kv, partial=True)
    bad = mutate(data, blob, fields_at)
    found = typed(lambda: kvstate.parse_partial(bad, kv.layout, kv.n), StateFormatError)
    if found is None:
        return
    only = StateLayout(kv.layout.partial)
    assert [s.layout for s in found] == list(only.sections)
    for s, naive in zip(found, read_naively(bad, only), strict=True):
        if isinstance(s, RecurrentCells):
            assert s.pos == kv.n - 1 and naive == (s.pos, bytes(s.data))
            assert len(s.data) == (s.layout.nbytes if s.pos >= 0 else 0)
        else:
            assert isinstance(naive, dict) and isinstance(s.layout, KvLayout)
            assert (s.p0, s.p0 + s.n) == ((s.layout.first(kv.n), kv.n) if s.n else (s.p0, s.p0))
            assert sorted(naive) == list(range(s.p0, s.p0 + s.n))
            assert all(pieces.cut(s, p, p + 1) == naive[p] for p in naive)
            if s.n:  # a cut read back as a piece holds the same cells
                whole = pieces.cells_from(
                    s.layout, s.p0, [pieces.piece(s.layout, pieces.cut(s, s.p0, s.p0 + s.n), s.n)]
                )
                assert all(pieces.cut(whole, p, p + 1) == naive[p] for p in naive)


# ---- exports -------------------------------------------------------------------------------

FINGERPRINT = "f" * 64
N_CTX = 256
IMPORT_LIMIT = 1 << 22


@contextlib.contextmanager
def memory_store(layout: StateLayout | None, codec: str = "lz4") -> Iterator[CheckpointStore]:
    """A checkpoint store in RAM, as storage.stores.open_stores makes the volatile one."""
    catalog = SqliteCatalog(":memory:")
    try:
        yield CheckpointStore(
            catalog,
            MemoryBlockStore(),
            KEY,
            fingerprint=FINGERPRINT,
            layout=layout,
            block_tokens=16,
            codec=codec,
            n_vocab=N_VOCAB,
        )
    finally:
        catalog.close()


def session_snapshot(tokens: list[int], rng: random.Random) -> Snapshot:
    """A session's snapshot as the daemon saves one (n_kv and the keys are the store's)."""
    return Snapshot(
        session_id="s_" + rng.randbytes(6).hex(),
        persistent=rng.random() < 0.5,
        created_at=1.0,
        tokens=tokens,
        n_kv=0,
        logits=np.linspace(-1, 1, N_VOCAB, dtype=np.float32) if rng.random() < 0.5 else None,
        draws=rng.randint(0, 9),
        params=SamplingParams(seed=rng.randint(0, 2**64 - 1)),
        stop=("\n",),
        messages=[ChatMessage("user", "hello", 0)],
        fingerprint=FINGERPRINT,
        kv_layout=None,
        block_tokens=16,
        label="fuzz",
    )


@dataclass(frozen=True)
class Export:
    """A valid export and the state it holds."""

    layout: StateLayout
    codec: str
    kv: SeqKv | None
    data: bytes


@st.composite
def exports(draw: st.DrawFn) -> Export:
    """A checkpoint of a state of 0-40 positions (up to 3 blocks of 16) of any layout,
    saved in a store of any codec and exported."""
    layout = draw(state_layouts())
    codec = draw(codecs)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, 40))
    tokens = [rng.randrange(N_VOCAB) for _ in range(n + draw(st.integers(0, 3)))]
    kv = make_state(layout, n, rng) if n else None
    with memory_store(layout, codec) as store:
        row, _ = store.save(session_snapshot(tokens, rng), kv, kind="explicit", now=0.0)
        return Export(layout, codec, kv, b"".join(kvexports.export(store, row.checkpoint_id)))


_REC = struct.Struct("<BI")


def records(export: bytes) -> list[tuple[int, bytes]]:
    """An export's records before the final digest: (type, payload)."""
    out: list[tuple[int, bytes]] = []
    at = len(EXPORT_MAGIC)
    while True:
        kind, length = _REC.unpack_from(export, at)
        if kind == 0:
            return out
        out.append((kind, export[at + 5 : at + 5 + length]))
        at += 5 + length


def seal(body: bytes) -> bytes:
    """An export's bytes before its final record, with the final record (BLAKE2b) after."""
    return body + _REC.pack(0, 32) + hashlib.blake2b(body, digest_size=32).digest()


def pack(recs: Sequence[tuple[int, bytes]], magic: bytes = EXPORT_MAGIC) -> bytes:
    return seal(magic + b"".join(_REC.pack(kind, len(body)) + body for kind, body in recs))


def edit_export(data: st.DataObject, export: Export) -> bytes:
    """An export with its records or bytes changed, and a digest that matches (mostly)."""
    recs = records(export.data)
    op = data.draw(
        st.sampled_from(
            ["bytes", "manifest", "manifest", "block", "block", "key", "records", "magic", "digest"]
        ),
        label="export-op",
    )
    blocks = [i for i, (kind, _) in enumerate(recs) if kind == 2]
    if op == "bytes":  # anywhere before the digest, records' headers included
        body = export.data[: -(_REC.size + 32)]
        fields_at: list[Field] = []
        at = len(EXPORT_MAGIC)
        for _, payload in recs:
            fields_at += [(at, 1), (at + 1, 4)]
            at += _REC.size + len(payload)
        return seal(mutate(data, body, fields_at))
    if op == "manifest":
        i = next(i for i, (kind, _) in enumerate(recs) if kind == 1)
        recs[i] = (1, edit_manifest(data, recs[i][1]))
    elif op == "block" and blocks:
        i = data.draw(st.sampled_from(blocks), label="block")
        key, frame = recs[i][1][:64], recs[i][1][64:]
        how = data.draw(st.sampled_from(["mutate", "reframe", "resize", "random", "bomb"]), label="how")
        _, _, length, _ = struct.unpack_from("<4sBII", frame)
        payload = bytes(blk.unframe(frame, length))
        if how == "mutate":
            frame = mutate(data, frame, FRAME_FIELDS)
        elif how == "reframe":
            frame = blk.frame(payload, data.draw(codecs, label="codec"))
        elif how == "resize":
            frame = blk.frame(payload + b"\x00" if data.draw(st.booleans()) else payload[:-1], "none")
        elif how == "random":  # any bytes of the right size: a load cannot tell
            frame = blk.frame(random.Random(length).randbytes(length), data.draw(codecs, label="codec"))
        else:
            body = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1 << 22))
            frame = struct.pack("<4sBII", blk.MAGIC, 2, length, zlib.crc32(payload)) + body
        recs[i] = (2, key + frame)
    elif op == "key" and blocks:
        i = data.draw(st.sampled_from(blocks), label="block")
        key = data.draw(
            st.sampled_from([b"0" * 64, b"A" * 64, b"\xff" * 64, recs[i][1][:63] + b"g", b""]) | st.binary(),
            label="key",
        )
        recs[i] = (2, key + recs[i][1][64:])
    elif op == "records":
        how = data.draw(st.sampled_from(["drop", "dup", "swap", "kind", "extra"]), label="how")
        i = data.draw(st.integers(0, len(recs) - 1), label="record")
        if how == "drop":
            del recs[i]
        elif how == "dup":
            recs.insert(i, recs[i])
        elif how == "swap":
            j = data.draw(st.integers(0, len(recs) - 1), label="other")
            recs[i], recs[j] = recs[j], recs[i]
        elif how == "kind":
            recs[i] = (data.draw(st.sampled_from([0, 1, 2, 3, 255]), label="kind"), recs[i][1])
        else:
            recs.insert(i, (2, data.draw(st.binary(max_size=80), label="extra")))
    elif op == "magic":
        return pack(recs, data.draw(st.sampled_from([b"KVSTEXP2", b"KVKPMAN1", b""]), label="magic"))
    elif op == "digest":  # the digest itself wrong, missing, or followed by more
        how = data.draw(st.sampled_from(["flip", "drop", "trail", "short"]), label="how")
        if how == "flip":
            return export.data[:-1] + bytes([export.data[-1] ^ 1])
        if how == "drop":
            return export.data[: -(_REC.size + 32)]
        if how == "trail":
            return export.data + b"\x00"
        body = export.data[: -(_REC.size + 32)]
        return body + _REC.pack(0, 31) + hashlib.blake2b(body, digest_size=32).digest()[:31]
    return pack(recs)


def chunked(data: bytes, rng: random.Random) -> Iterator[bytes]:
    """The stream as a client sends it: chunks of any size."""
    at = 0
    while at < len(data):
        size = rng.choice([1, 7, 64, 1000, 1 << 20])
        yield data[at : at + size]
        at += size


def imports_or_refuses(
    store: CheckpointStore, data: bytes, rng: random.Random, limit: int = IMPORT_LIMIT
) -> str | None:
    """The id of the checkpoint the export imports as, or None if refused with a
    KvkeepError (CorruptCheckpoint, IncompatibleCheckpoint, InvalidRequest)."""
    row = typed(
        lambda: kvexports.import_chunks(store, chunked(data, rng), limit, 0.0, tenant="t", n_ctx=N_CTX),
        KvkeepError,
    )
    return None if row is None else row.checkpoint_id


def check_imported(store: CheckpointStore, checkpoint_id: str, rng: random.Random) -> ckpt.Loaded:
    """An imported checkpoint loads (its state checked as parse checks one: the full
    section at 0..n-1, the window its last positions, the recurrent state at n-1), and its
    export imports again."""
    loaded = store.load(checkpoint_id, 0.0)
    snap = loaded.snapshot
    mf.check_limits(snap, N_CTX)
    if loaded.kv is not None:
        assert store.layout is not None
        assert loaded.kv.n == snap.n_kv
        blob, _ = write_state(loaded.kv)
        check_state(kvstate.parse(blob, store.layout), store.layout, blob)
    again = b"".join(kvexports.export(store, checkpoint_id))
    with memory_store(store.layout, store.codec) as other:
        assert imports_or_refuses(other, again, rng) is not None
    return loaded


@fuzz(100)
@given(exports(), st.integers(0, 2**32 - 1))
def test_exports_import_and_load_back_equal(export: Export, order: int) -> None:
    """A valid export, in chunks of any size, imports into a store of the same layout (any
    codec) and loads back the same state; into a store of another layout, it imports and
    loads as tokens to evaluate again."""
    rng = random.Random(order)
    with memory_store(export.layout, rng.choice(sorted(blk.CODECS))) as store:
        checkpoint_id = imports_or_refuses(store, export.data, rng)
        assert checkpoint_id is not None
        loaded = check_imported(store, checkpoint_id, rng)
        if export.kv is None:
            assert loaded.kv is None and not loaded.reprefill
        else:
            assert loaded.kv is not None and content(loaded.kv) == content(export.kv)
    other = NAMED["kv"] if export.layout != NAMED["kv"] else NAMED["recurrent"]
    with memory_store(other) as store:
        checkpoint_id = imports_or_refuses(store, export.data, rng)
        assert checkpoint_id is not None
        loaded = check_imported(store, checkpoint_id, rng)
        assert loaded.kv is None and loaded.reprefill == (export.kv is not None)
    with memory_store(export.layout) as store:  # the limit counts what has arrived
        assert imports_or_refuses(store, export.data, rng, limit=len(export.data) - 1) is None


@fuzz(350)
@given(exports(), st.integers(0, 2**32 - 1), st.data())
def test_edited_exports_are_refused_or_import_into_checkpoints_that_load(
    export: Export, order: int, data: st.DataObject
) -> None:
    """An export with its bytes, records, manifest fields, block keys or block frames
    changed (the final BLAKE2b recomputed, so the checks inside are reached), or with a
    wrong digest: refused with a KvkeepError, or imported into a checkpoint that loads
    (only typed errors) a state that keeps parse's promises, and exports again."""
    bad = edit_export(data, export)
    rng = random.Random(order)
    with memory_store(export.layout, export.codec) as store:
        checkpoint_id = imports_or_refuses(store, bad, rng)
        if checkpoint_id is not None:
            check_imported(store, checkpoint_id, rng)


#: Every kind of section at once: full attention, a 3-position window, a recurrent state.
ALL_SECTIONS = StateLayout((*NAMED["iswa"].sections, *NAMED["hybrid"].sections[1:]))


def test_every_field_of_an_exported_manifest_with_every_wrong_value_is_refused_or_loads() -> None:
    """Exhaustively, every field and sampling parameter of the manifest of an export (a
    state with all three kinds of section over 20 positions) set to every value of NASTY
    and RAW_JSON, or removed, the export's digest recomputed: refused with a KvkeepError,
    or imported into a checkpoint that loads and exports again."""
    rng = random.Random(7)
    tokens = [rng.randrange(N_VOCAB) for _ in range(24)]
    with memory_store(ALL_SECTIONS) as store:
        row, _ = store.save(
            session_snapshot(tokens, rng), make_state(ALL_SECTIONS, 20, rng), kind="explicit", now=0.0
        )
        recs = records(b"".join(kvexports.export(store, row.checkpoint_id)))
    manifest = next(body for kind, body in recs if kind == 1)
    for path in paths(ManifestParts.of(manifest).meta):
        if len(path) > 1 and path[0] != "params":  # nested lists: decode's grid has them
            continue
        for value in [*NASTY, *map(Raw, RAW_JSON), "delete"]:
            parts = ManifestParts.of(manifest)
            if not path:
                if value == "delete":
                    continue
                parts.meta = value
            else:
                parent = parts.meta
                for p in path[:-1]:
                    parent = parent[p]
                if value == "delete":
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = value
            bad = pack([(kind, parts.join() if kind == 1 else body) for kind, body in recs])
            with memory_store(ALL_SECTIONS) as dest:
                checkpoint_id = imports_or_refuses(dest, bad, rng)
                if checkpoint_id is not None:
                    check_imported(dest, checkpoint_id, rng)


# ---- the bugs found, each with its minimal input ---------------------------------------------------


def bare_manifest(meta: dict[str, Any]) -> bytes:
    """A manifest of no tokens and no logits around this JSON; its MAC zeros (imports read
    manifests with key=None, which does not check it)."""
    head = json.dumps(meta).encode()
    return mf.MAGIC + struct.pack("<I", len(head)) + head + struct.pack("<II", 0, 0) + bytes(mf.MAC_BYTES)


#: The fields decode() requires (the optional ones it defaults are left out).
BARE: dict[str, Any] = {
    "format": 1,
    "n_kv": 0,
    "params": {
        "temperature": 1,
        "top_k": 0,
        "top_p": 1,
        "min_p": 0,
        "repeat_penalty": 1,
        "penalty_last_n": 0,
        "seed": 0,
    },
    "messages": [],
    "stop": [],
    "blocks": [],
    "created_at": 0,
    "saved_at": 0,
    "block_tokens": 16,
    "session_id": "",
    "persistent": False,
    "label": "",
    "draws": 0,
    "fingerprint": "",
}


def test_a_bare_manifest_decodes() -> None:
    """BARE decodes (so the xfail tests below fail where they say, not earlier)."""
    assert mf.decode(bare_manifest(BARE), None, N_VOCAB).created_at == 0.0


def test_a_manifest_timestamp_beyond_float_range_is_refused() -> None:
    """A JSON integer beyond float range as a timestamp is CorruptCheckpoint, not OverflowError."""
    with pytest.raises(CorruptCheckpoint):
        mf.decode(bare_manifest({**BARE, "created_at": 10**400}), None, N_VOCAB)


def test_a_zstd_frame_declaring_a_huge_content_size_is_refused() -> None:
    """A 32-byte zstd frame whose header declares 2**62 bytes is refused unread (zstd's
    `max_output_size` is ignored when a frame declares its size: it would allocate it)."""
    header = struct.pack("<4sBII", blk.MAGIC, 2, 16, zlib.crc32(bytes(16)))
    frame = header + zstd_raw_frame(bytes(16), 1 << 62)
    with pytest.raises(CorruptCheckpoint):
        blk.unframe(frame, 16)


def test_a_zstd_bomb_with_its_content_size_is_refused_without_expanding() -> None:
    """A real bomb: 64 MiB of zeros, ~2 KB compressed with their size in the header, claimed
    as a 64-byte block, is refused while allocating under 1 MiB."""
    body = zstandard.ZstdCompressor(level=3).compress(bytes(BOMB))
    frame = struct.pack("<4sBII", blk.MAGIC, 2, 64, zlib.crc32(bytes(64))) + body
    assert len(frame) < 4096
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpoint):
            blk.unframe(frame, 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"unframe of a {len(frame)}-byte frame allocated {peak >> 20} MiB"


def exported_with(**edits: Any) -> bytes:
    """A valid export of one position of NAMED["kv"], its manifest's fields edited."""
    rng = random.Random(1)
    with memory_store(NAMED["kv"]) as store:
        row, _ = store.save(
            session_snapshot([1], rng), make_state(NAMED["kv"], 1, rng), kind="explicit", now=0.0
        )
        recs = records(b"".join(kvexports.export(store, row.checkpoint_id)))
    out = []
    for kind, body in recs:
        if kind == 1:
            parts = ManifestParts.of(body)
            parts.meta.update(edits)
            body = parts.join()
        out.append((kind, body))
    return pack(out)


def test_the_edited_exports_import_unedited() -> None:
    """exported_with() makes an export that imports (so the xfail tests below fail where
    they say, not earlier)."""
    with memory_store(NAMED["kv"]) as store:
        assert imports_or_refuses(store, exported_with(label="x"), random.Random(1))


def test_an_export_with_a_salt_of_odd_length_is_refused() -> None:
    """A salt of hex digits of odd length (which bytes.fromhex refuses) is refused by the
    manifest's checks, with a typed error."""
    with memory_store(NAMED["kv"]) as store, pytest.raises(KvkeepError):
        kvexports.import_chunks(store, [exported_with(salt="a")], IMPORT_LIMIT, 0.0, tenant="t", n_ctx=N_CTX)


def test_an_export_with_a_lone_surrogate_in_its_label_is_refused() -> None:
    """JSON may escape a lone surrogate ("\\ud800"), which neither sqlite nor a gRPC reply can
    encode: a manifest holding one anywhere is refused with a typed error."""
    with memory_store(NAMED["kv"]) as store, pytest.raises(KvkeepError):
        kvexports.import_chunks(
            store, [exported_with(label="\ud800")], IMPORT_LIMIT, 0.0, tenant="t", n_ctx=N_CTX
        )
