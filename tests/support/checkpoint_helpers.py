"""Helpers of the checkpoint, integrity and crash tests.

- token sequences: ``gen`` (the token ids of one generation);
- ``Background``: threads that keep other sessions decoding while a test checks exactness;
- the state directory as the tests see it: ``listing``, ``block_files``, ``flip_bit``;
- the export format of ``kvkeepd.storage.checkpoints`` (records, final BLAKE2b) and the manifest format
  of ``kvkeepd.state.manifest``, read and rebuilt so that a test can forge a valid-looking export;
- ``make_other_model``: the default GGUF with one tensor changed (another fingerprint);
- ``own_daemon``: an in-process daemon on any model (the ``start_daemon`` fixture fixes the
  model to the default one).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import shutil
import sqlite3
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from daemons import TEST_DEFAULTS, InProcessDaemon, model_path

import kvkeep
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc
from kvkeepd.config.settings import Settings

#: Sampled (not greedy) with a fixed seed: exactness must hold for the RNG too.
SEED = 12345
SAMPLED = kvkeep.SamplingParams(temperature=0.8, seed=SEED)
GREEDY = kvkeep.SamplingParams(temperature=0.0, seed=SEED)

PROMPT = "The old lighthouse keeper climbed the stairs every night and"

#: One llama.cpp thread per daemon. With two on a two-core machine, the daemon's own Python
#: threads, the test's client threads and any other daemon oversubscribe the cores, and
#: llama.cpp's spinning worker threads slow decoding down 10-20 times.
THREADS = 1
SPAWN_ARGS = ("--threads", str(THREADS))

EXPORT_MAGIC = b"KVKPEXP1"
MANIFEST_MAGIC = b"KVKPMAN1"
_REC = struct.Struct("<BI")
_MAC_BYTES = 32


Trace = list[tuple[int, float]]


def gen(session: kvkeep.Session, prompt: str | Sequence[int] = "", n: int = 16, **kw: Any) -> Trace:
    """One generation of exactly ``n`` tokens: (token id, log-probability) per token.

    Comparing log-probabilities too makes every exactness check bit-exact on the logits, not
    only on the sampled tokens (a small drift in the logits rarely changes a token).
    """
    completion = session.complete(prompt, max_tokens=n, logprobs=1, **kw)
    assert completion.finish_reason == "length", (completion.finish_reason, completion.token_ids)
    assert len(completion.token_ids) == n
    trace = [(t.sampled.token_id, t.sampled.logprob) for t in completion.logprobs]
    assert [t for t, _ in trace] == list(completion.token_ids)
    return trace


def ids(trace: Trace) -> list[int]:
    return [t for t, _ in trace]


def long_text(n_sentences: int, topic: str = "harbour") -> str:
    """Varied English text, roughly 12-14 tokens per sentence."""
    words = ["amber", "lantern", "granite", "meadow", "copper", "willow", "saffron", "harvest"]
    return " ".join(
        f"Note {i} about the {topic}: the {words[i % 8]} {words[(i * 3 + 1) % 8]} rests near "
        f"pier {i * 7 % 101}."
        for i in range(n_sentences)
    )


def restore_raw(address: str, session_id: str, checkpoint_id: str) -> pb.RestoreCheckpointResponse:
    """RestoreCheckpoint through the raw stub: the SDK does not expose ``reprefilled``."""
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.KvKeepStub(channel).RestoreCheckpoint(
            pb.RestoreCheckpointRequest(session_id=session_id, checkpoint_id=checkpoint_id),
            timeout=60,
        )


class Background:
    """``n`` threads, each on its own session of the daemon at ``address``, generating short
    sampled continuations in a loop until the block ends; so that the checks run while other
    sessions are decoding in the same engine batch (and compete for slots). A failure of a
    background thread fails the test at the end of the block.
    """

    def __init__(self, address: str, n: int = 2) -> None:
        self.address = address
        self.n = n
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.generated = 0
        self._threads: list[threading.Thread] = []
        self._started = threading.Barrier(n + 1)

    def _run(self, i: int) -> None:
        try:
            with kvkeep.Client(self.address, timeout=60) as client:
                session = client.create_session(
                    sampling=kvkeep.SamplingParams(temperature=1.0, seed=1000 + i)
                )
                first = True
                self._started.wait(60)
                while not self.stop.is_set():
                    c = session.complete(f"Background story number {i}:" if first else "", max_tokens=3)
                    first = False
                    self.generated += len(c.token_ids)
                    if c.finish_reason != "length" or session.info().n_tokens > 800:
                        session.rewind(1)
                with contextlib.suppress(kvkeep.KvkeepError):
                    session.close()
        except BaseException as e:
            self.errors.append(e)
            with contextlib.suppress(threading.BrokenBarrierError):
                self._started.abort()

    def __enter__(self) -> Background:
        for i in range(self.n):
            t = threading.Thread(target=self._run, args=(i,), name=f"background-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            self._started.wait(120)
        except threading.BrokenBarrierError:
            self.stop.set()
            for t in self._threads:
                t.join(60)
            raise AssertionError(f"a background session failed to start: {self.errors!r}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(120)
        assert not any(t.is_alive() for t in self._threads), "a background thread hangs"
        if exc[0] is None:
            assert not self.errors, f"background generation failed: {self.errors!r}"
            assert self.generated > 0, "the background sessions generated nothing"


# ---- the state directory -------------------------------------------------------------------


def listing(root: Path) -> dict[str, int]:
    """Every file under ``root`` (nothing excluded): relative path -> size in bytes."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def block_files(state_dir: Path) -> dict[str, Path]:
    """The block files of a state directory, by key (tmp/ excluded)."""
    root = state_dir / "blocks"
    return {
        p.name: p
        for sub in root.iterdir()
        if sub.is_dir() and sub.name != "tmp"
        for p in sub.iterdir()
        if p.is_file()
    }


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def catalog_manifest(state_dir: Path, checkpoint_id: str) -> bytes:
    with contextlib.closing(sqlite3.connect(state_dir / "catalog.db", timeout=30)) as db:
        row = db.execute(
            "SELECT manifest FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,)
        ).fetchone()
    assert row is not None, f"no catalog row for {checkpoint_id}"
    return bytes(row[0])


def set_catalog_manifest(state_dir: Path, checkpoint_id: str, manifest: bytes) -> None:
    """Overwrite a manifest in the catalog of a running daemon (sqlite3 in WAL mode copes)."""
    with contextlib.closing(sqlite3.connect(state_dir / "catalog.db", timeout=30)) as db:
        with db:
            cur = db.execute(
                "UPDATE checkpoints SET manifest = ? WHERE checkpoint_id = ?",
                (manifest, checkpoint_id),
            )
        assert cur.rowcount == 1


# ---- exports and manifests -----------------------------------------------------------------


def parse_export(data: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(manifest, [(block key, framed block)]) of a valid export; asserts its digest."""
    assert data.startswith(EXPORT_MAGIC)
    at = len(EXPORT_MAGIC)
    manifest = b""
    blocks: list[tuple[str, bytes]] = []
    while True:
        kind, length = _REC.unpack_from(data, at)
        body = data[at + _REC.size : at + _REC.size + length]
        if kind == 0:
            assert body == hashlib.blake2b(data[:at], digest_size=32).digest()
            assert at + _REC.size + length == len(data)
            return manifest, blocks
        if kind == 1:
            manifest = body
        else:
            assert kind == 2
            blocks.append((body[:64].decode(), body[64:]))
        at += _REC.size + length


def build_export(manifest: bytes, blocks: Sequence[tuple[str, bytes]]) -> bytes:
    """An export stream with a correct final digest."""
    out = bytearray(EXPORT_MAGIC)
    out += _REC.pack(1, len(manifest)) + manifest
    for key, block in blocks:
        out += _REC.pack(2, 64 + len(block)) + key.encode() + block
    out += _REC.pack(0, 32) + hashlib.blake2b(bytes(out), digest_size=32).digest()
    return bytes(out)


def manifest_parts(manifest: bytes) -> tuple[dict[str, Any], list[int], bytes]:
    """(JSON metadata, token ids, the bytes after the JSON: tokens, logits and MAC)."""
    assert manifest.startswith(MANIFEST_MAGIC)
    (n,) = struct.unpack_from("<I", manifest, len(MANIFEST_MAGIC))
    start = len(MANIFEST_MAGIC) + 4
    meta = json.loads(manifest[start : start + n])
    rest = manifest[start + n :]
    (n_tokens,) = struct.unpack_from("<I", rest)
    tokens = list(struct.unpack_from(f"<{n_tokens}i", rest, 4))
    return meta, tokens, rest


def edit_manifest(manifest: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The manifest with its JSON metadata edited (lengths fixed; the MAC is left as it was,
    since imports cannot check a MAC made with another daemon's key)."""
    meta, _, rest = manifest_parts(manifest)
    edit(meta)
    head = json.dumps(meta, separators=(",", ":")).encode()
    return MANIFEST_MAGIC + struct.pack("<I", len(head)) + head + rest


def remac(manifest: bytes, key: bytes) -> bytes:
    """The manifest with its HMAC-SHA256 recomputed with ``key`` (a store's ``store.key``)."""
    body = manifest[:-_MAC_BYTES]
    return body + hmac.new(key, body, hashlib.sha256).digest()


def edit_export(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    manifest, blocks = parse_export(data)
    return build_export(edit_manifest(manifest, edit), blocks)


def export_bytes(client: kvkeep.Client, checkpoint_id: str, path: Path) -> bytes:
    written = client.export_checkpoint(checkpoint_id, path)
    data = path.read_bytes()
    assert written == len(data) > 0
    return data


def checkpoint_tokens(client: kvkeep.Client, checkpoint_id: str, tmp: Path) -> list[int]:
    """The token history saved in a checkpoint, read from its export."""
    manifest, _ = parse_export(export_bytes(client, checkpoint_id, tmp / f"{checkpoint_id}.tokens"))
    return manifest_parts(manifest)[1]


def manifest_blocks(manifest: bytes) -> list[str]:
    return list(manifest_parts(manifest)[0]["blocks"])


# ---- exactness of a whole history ----------------------------------------------------------


def continues_like_its_history(client: kvkeep.Client, session_id: str, tmp: Path) -> None:
    """The session's next tokens equal those of a fresh session given its whole history."""
    session = client.session(session_id)
    tokens = checkpoint_tokens(client, session.checkpoint("audit").checkpoint_id, tmp)
    if len(tokens) > 900:  # near the end of the context: make room first
        session.rewind(600)
        tokens = tokens[:600]
    control = client.create_session()
    try:
        if not tokens:  # rewound to nothing: both start from the same prompt
            assert next_tokens(session, "Hello") == next_tokens(control, "Hello"), session_id
        else:
            assert next_tokens(session, "") == next_tokens(control, tokens), session_id
    finally:
        control.close()


def next_tokens(session: kvkeep.Session, prompt: str | list[int]) -> tuple[str | None, Trace]:
    """Greedy (the draw counter does not matter): up to 6 tokens and their log-probabilities."""
    c = session.complete(prompt, max_tokens=6, logprobs=1, sampling=GREEDY)
    return c.finish_reason, [(t.sampled.token_id, t.sampled.logprob) for t in c.logprobs]


# ---- models and daemons --------------------------------------------------------------------


def make_other_model(dst: Path) -> Path:
    """A copy of the default model with the lowest mantissa bit of a few weights of one F32
    tensor flipped: it loads and behaves (almost) the same, but has another fingerprint."""
    import gguf

    src = model_path()
    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(src)
    tensor = next(t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.F32)
    offset = int(tensor.data_offset)
    del reader
    with dst.open("r+b") as f:
        for i in range(8):
            f.seek(offset + 4 * i)
            b = f.read(1)
            f.seek(offset + 4 * i)
            f.write(bytes([b[0] ^ 1]))
    return dst


@contextlib.contextmanager
def own_daemon(state_dir: Path, *, model: Path | None = None, **settings: Any) -> Iterator[InProcessDaemon]:
    """An in-process daemon on ``model`` (default: the default model), stopped afterwards."""
    options = {**TEST_DEFAULTS, "threads": THREADS, **settings}
    s = Settings(model_path=model or model_path(), state_dir=state_dir, **options)
    d = InProcessDaemon(s.validate())
    try:
        yield d
        problems = d.check_invariant()
        assert not problems, "; ".join(problems)
    finally:
        d.stop()
