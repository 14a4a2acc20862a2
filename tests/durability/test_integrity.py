"""Nothing unchecked reaches llama.cpp.

Every damaged or foreign checkpoint is refused with DATA_LOSS (CorruptCheckpointError) or
FAILED_PRECONDITION (IncompatibleCheckpointError) and a message that says what is wrong; the
daemon keeps serving, and every other session and checkpoint stays intact: a good checkpoint
restored afterwards continues exactly as before the damage.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from checkpoint_helpers import (
    GREEDY,
    PROMPT,
    SAMPLED,
    Trace,
    block_files,
    build_export,
    catalog_manifest,
    checkpoint_tokens,
    edit_export,
    edit_manifest,
    export_bytes,
    flip_bit,
    gen,
    make_other_model,
    manifest_blocks,
    own_daemon,
    parse_export,
    remac,
    restore_raw,
    set_catalog_manifest,
)
from daemons import InProcessDaemon, check_serving

import kvkeep
from kvkeepd.state import frames as blk
from kvkeepd.state.layout import STATE_VERSION

BLOCK_HEADER = 4 + 1 + 4 + 32  # magic, codec, payload length, BLAKE2b (kvkeepd.state.frames)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """The daemon whose store the tests damage (one for the module: it must survive it all)."""
    with own_daemon(tmp_path_factory.mktemp("integrity")) as d:
        yield d


@pytest.fixture
def client(node: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(node.address, timeout=60) as c:
        yield c


# The continuation's prompt: the middle of a sentence, which the model does not end at once.
GO_ON = " Then"


@dataclass
class Saved:
    """A persistent session with a checkpoint and the continuation that follows it."""

    text: str
    session: kvkeep.Session
    checkpoint: kvkeep.CheckpointInfo
    after: Trace

    def still_exact(self) -> None:
        """The checkpoint restores and continues exactly (the session is usable, too)."""
        self.session.restore(self.checkpoint.checkpoint_id)
        assert gen(self.session, GO_ON, 8) == self.after
        fork = self.session.fork(self.checkpoint.checkpoint_id)
        assert gen(fork, GO_ON, 8) == self.after
        fork.close()


def saved(client: kvkeep.Client, text: str, seed: int = SAMPLED.seed or 0) -> Saved:
    """A persistent session on ``text`` (unique per test: equal tokens would share blocks
    with the checkpoints of other tests, damaged ones included)."""
    session = client.create_session(
        sampling=kvkeep.SamplingParams(temperature=0.8, seed=seed), persistent=True
    )
    gen(session, text, 8)
    checkpoint = session.checkpoint(text[:20])
    after = gen(session, GO_ON, 8)
    # Cells taken away (a rewind), so that restoring the checkpoint reads its blocks instead
    # of cutting the session's own cells (see Residency.rewind_to).
    session.rewind(checkpoint.n_tokens)
    return Saved(text, session, checkpoint, after)


def own_blocks(state_dir: Path, bad: Saved, *others: Saved) -> list[Path]:
    """Block files of ``bad``'s checkpoint that no other checkpoint references."""
    mine = manifest_blocks(catalog_manifest(state_dir, bad.checkpoint.checkpoint_id))
    shared: set[str] = set()
    for o in others:
        shared |= set(manifest_blocks(catalog_manifest(state_dir, o.checkpoint.checkpoint_id)))
    files = block_files(state_dir)
    found = [files[k] for k in mine if k not in shared]
    assert found, "the checkpoint has no block of its own"
    return found


def assert_refused(
    call: Callable[[], Any], error: type[kvkeep.KvkeepError], *words: str
) -> kvkeep.KvkeepError:
    with pytest.raises(error) as info:
        call()
    message = info.value.message.lower()
    assert any(w in message for w in words), message
    return info.value


def expect_intact(client: kvkeep.Client, good: Saved) -> None:
    check_serving(client)
    good.still_exact()


@pytest.fixture
def pair(request: pytest.FixtureRequest, client: kvkeep.Client) -> Iterator[tuple[Saved, Saved]]:
    """(good, bad): two persistent sessions with checkpoints, on texts unique to the test."""
    name = request.node.name
    good = saved(client, f"Good {name}: {PROMPT}")
    bad = saved(client, f"Bad {name}: the ferry left the island at dawn and", seed=7)
    yield good, bad
    for s in (good, bad):
        with contextlib.suppress(kvkeep.KvkeepError):
            s.session.close()


# ---- the local store --------------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 10, BLOCK_HEADER, -1], ids=["empty", "in-header", "no-body", "last-byte"])
def test_a_truncated_block_file(
    node: InProcessDaemon, client: kvkeep.Client, pair: tuple[Saved, Saved], cut: int
) -> None:
    good, bad = pair
    path = own_blocks(node.settings.state_dir, bad, good)[-1]
    size = path.stat().st_size
    os.truncate(path, cut % size)

    for call in (
        lambda: bad.session.restore(bad.checkpoint.checkpoint_id),
        lambda: bad.session.fork(bad.checkpoint.checkpoint_id),
    ):
        assert_refused(call, kvkeep.CorruptCheckpointError, "block")
    # The failed restore left the session as it was: it still continues.
    assert len(gen(bad.session, "", 4)) == 4
    expect_intact(client, good)


@pytest.mark.parametrize(
    "where", ["magic", "codec", "length", "digest", "body", "last"], ids=lambda w: str(w)
)
def test_a_flipped_bit_in_a_block_file(
    node: InProcessDaemon, client: kvkeep.Client, pair: tuple[Saved, Saved], where: str
) -> None:
    good, bad = pair
    path = own_blocks(node.settings.state_dir, bad, good)[0]
    size = path.stat().st_size
    offset = {
        "magic": 1,
        "codec": 4,
        "length": 6,
        "digest": 20,
        "body": (BLOCK_HEADER + size) // 2,
        "last": size - 1,
    }[where]
    flip_bit(path, offset, bit=3)
    assert path.stat().st_size == size

    assert_refused(
        lambda: bad.session.restore(bad.checkpoint.checkpoint_id),
        kvkeep.CorruptCheckpointError,
        "block",
    )
    assert_refused(
        lambda: bad.session.fork(bad.checkpoint.checkpoint_id),
        kvkeep.CorruptCheckpointError,
        "block",
    )
    # An export of the damaged checkpoint is refused, or refused on import: never silently
    # passed on with a fresh, valid digest over damaged data.
    try:
        data = export_to_memory(client, bad.checkpoint.checkpoint_id)
    except kvkeep.CorruptCheckpointError:
        pass
    else:
        assert_refused(
            lambda: client.import_checkpoint(io.BytesIO(data)), kvkeep.CorruptCheckpointError, "block"
        )
    expect_intact(client, good)


def export_to_memory(client: kvkeep.Client, checkpoint_id: str) -> bytes:
    buf = io.BytesIO()
    client.export_checkpoint(checkpoint_id, buf)
    return buf.getvalue()


@pytest.mark.parametrize("where", ["magic", "json", "tokens", "mac"])
def test_a_flipped_bit_in_a_manifest(
    node: InProcessDaemon, client: kvkeep.Client, pair: tuple[Saved, Saved], where: str
) -> None:
    """The manifest is a BLOB in catalog.db, edited with sqlite3 while the daemon runs."""
    state_dir = node.settings.state_dir
    good, bad = pair
    manifest = bytearray(catalog_manifest(state_dir, bad.checkpoint.checkpoint_id))
    (json_len,) = struct.unpack_from("<I", manifest, 8)
    offset = {
        "magic": 2,
        "json": 12 + json_len // 2,
        "tokens": 12 + json_len + 4 + 5,
        "mac": len(manifest) - 1,
    }[where]
    manifest[offset] ^= 0x10
    set_catalog_manifest(state_dir, bad.checkpoint.checkpoint_id, bytes(manifest))

    listed = [c.checkpoint_id for c in bad.session.checkpoints()]
    assert bad.checkpoint.checkpoint_id in listed
    words = ("manifest", "hmac", "integrity")
    assert_refused(
        lambda: bad.session.restore(bad.checkpoint.checkpoint_id),
        kvkeep.CorruptCheckpointError,
        *words,
    )
    assert_refused(
        lambda: bad.session.fork(bad.checkpoint.checkpoint_id), kvkeep.CorruptCheckpointError, *words
    )
    assert_refused(
        lambda: export_to_memory(client, bad.checkpoint.checkpoint_id),
        kvkeep.CorruptCheckpointError,
        *words,
    )
    assert len(gen(bad.session, "", 4)) == 4
    expect_intact(client, good)
    client.delete_checkpoint(bad.checkpoint.checkpoint_id)
    assert bad.checkpoint.checkpoint_id not in [c.checkpoint_id for c in bad.session.checkpoints()]


# ---- imports ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_export(node: InProcessDaemon, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """An export of a healthy checkpoint of ``node`` (PROMPT + 8 tokens)."""
    with kvkeep.Client(node.address, timeout=60) as client:
        s = client.create_session(sampling=SAMPLED)
        gen(s, PROMPT, 8)
        ck = s.checkpoint("exported")
        return export_bytes(client, ck.checkpoint_id, tmp_path_factory.mktemp("exp") / "good.kvst")


def test_the_good_export_imports_and_continues_exactly(client: kvkeep.Client, good_export: bytes) -> None:
    """The control for the tests below: unmodified, the export is accepted."""
    manifest, blocks = parse_export(good_export)
    assert build_export(manifest, blocks) == good_export
    imported = client.import_checkpoint(io.BytesIO(good_export))
    ref = client.create_session(sampling=SAMPLED)
    expected = gen(ref, PROMPT, 16)[8:]
    assert gen(client.fork_session(checkpoint_id=imported.checkpoint_id), "", 8) == expected


# Prompts unique per call (see `saved`), the same in every run: a sampled continuation that
# happened to end early would otherwise make the test fail only sometimes.
_UNIQUE = (i * 0x9E3779B97F4A7C15 % (1 << 64) for i in itertools.count(1))


def _refused_import(client: kvkeep.Client, data: bytes, error: type[kvkeep.KvkeepError], *words: str) -> None:
    good = saved(client, f"Good {next(_UNIQUE):x}: {PROMPT}")
    before = {s.session_id for s in client.list_sessions()}
    assert_refused(lambda: client.import_checkpoint(io.BytesIO(data)), error, *words)
    assert {s.session_id for s in client.list_sessions()} == before
    expect_intact(client, good)
    good.session.close()


def test_random_bytes_are_refused(client: kvkeep.Client) -> None:
    rng = random.Random(5)
    noise = bytes(rng.getrandbits(8) for _ in range(100_000))
    _refused_import(client, noise, kvkeep.CorruptCheckpointError, "not a kvkeep")
    _refused_import(client, b"", kvkeep.CorruptCheckpointError, "not a kvkeep")
    _refused_import(client, b"KVKPEXP1" + noise, kvkeep.CorruptCheckpointError, "export")


@pytest.mark.parametrize(
    "where", ["magic", "record-header", "manifest", "block", "digest", "truncated", "trailing"]
)
def test_a_changed_byte_in_an_export_is_refused(
    client: kvkeep.Client, good_export: bytes, where: str
) -> None:
    data = bytearray(good_export)
    manifest, _ = parse_export(good_export)
    first_block = 8 + 5 + len(manifest)
    if where == "truncated":
        data = data[: len(data) // 2]
    elif where == "trailing":
        data += b"\0"
    else:
        offset = {
            "magic": 3,
            "record-header": 9,
            "manifest": 8 + 5 + len(manifest) // 2,
            "block": first_block + 5 + 64 + 100,
            "digest": len(data) - 1,
        }[where]
        data[offset] ^= 0x01
    _refused_import(client, bytes(data), kvkeep.CorruptCheckpointError, "checkpoint", "export")


def test_a_forged_export_with_a_valid_digest_is_still_checked(
    client: kvkeep.Client, good_export: bytes
) -> None:
    """Recomputing the export's digest does not get damage past the other checks."""
    manifest, blocks = parse_export(good_export)

    # A token changed: the block keys no longer follow from the tokens.
    m = bytearray(manifest)
    (json_len,) = struct.unpack_from("<I", m, 8)
    tok_at = 12 + json_len + 4
    (t0,) = struct.unpack_from("<i", m, tok_at + 4)
    struct.pack_into("<i", m, tok_at + 4, t0 + 1)
    _refused_import(client, build_export(bytes(m), blocks), kvkeep.CorruptCheckpointError, "block")

    # A block replaced by a correctly framed block of the wrong size.
    key, framed = blocks[0]
    payload = blk.unframe(framed, struct.unpack_from("<I", framed, 5)[0])
    short = blk.frame(payload[:-16], "lz4")
    _refused_import(
        client, build_export(manifest, [(key, short), *blocks[1:]]), kvkeep.CorruptCheckpointError, "block"
    )

    # A block missing.
    if len(blocks) > 1:
        _refused_import(client, build_export(manifest, blocks[1:]), kvkeep.CorruptCheckpointError, "block")

    # A token id outside the vocabulary.
    struct.pack_into("<i", m, tok_at + 4, 10_000_000)
    _refused_import(client, build_export(bytes(m), blocks), kvkeep.CorruptCheckpointError, "vocabulary")


def test_another_format_version_is_refused(client: kvkeep.Client, good_export: bytes) -> None:
    def bump(meta: dict[str, Any]) -> None:
        assert meta["format"] == 1
        meta["format"] = 2

    _refused_import(
        client, edit_export(good_export, bump), kvkeep.IncompatibleCheckpointError, "format version 2"
    )


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_other_model(tmp_path_factory.mktemp("model") / "other.gguf")


def test_a_checkpoint_of_another_model_is_refused(
    node: InProcessDaemon,
    client: kvkeep.Client,
    good_export: bytes,
    other_model: Path,
    tmp_path: Path,
) -> None:
    with (
        own_daemon(tmp_path / "other", model=other_model) as other,
        kvkeep.Client(other.address, timeout=60) as other_client,
    ):
        assert other_client.info().model_fingerprint != client.info().model_fingerprint
        _refused_import(other_client, good_export, kvkeep.IncompatibleCheckpointError, "another model")

        s = other_client.create_session(sampling=SAMPLED)
        gen(s, PROMPT, 8)
        theirs = export_bytes(other_client, s.checkpoint().checkpoint_id, tmp_path / "theirs.kvst")
        check_serving(other_client)
    _refused_import(client, theirs, kvkeep.IncompatibleCheckpointError, "another model")


@pytest.mark.parametrize("kv_type", ["q8_0"])
def test_a_checkpoint_of_another_kv_type_restores_by_evaluating_its_history(
    node: InProcessDaemon, client: kvkeep.Client, good_export: bytes, tmp_path: Path, kv_type: str
) -> None:
    """Its state does not fit this daemon's KV layout, its tokens do: the restore evaluates
    them again and says so, and the session continues as one that evaluated them itself."""
    with (
        own_daemon(tmp_path / "q", kv_type=kv_type) as q,
        kvkeep.Client(q.address, timeout=60) as q_client,
    ):
        info = q_client.info()
        assert (info.kv_type, info.mode) == (kv_type, "compact")
        ours = q_client.import_checkpoint(io.BytesIO(good_export))
        s = q_client.create_session(sampling=SAMPLED)
        response = restore_raw(q.address, s.session_id, ours.checkpoint_id)
        assert response.reprefilled and response.session.n_tokens == ours.n_tokens
        s.complete(max_tokens=4)  # compact mode: other logits, may end early on EOS

        s = q_client.create_session(sampling=SAMPLED)
        s.complete(PROMPT, max_tokens=8)
        theirs = export_bytes(q_client, s.checkpoint().checkpoint_id, tmp_path / "q8.kvst")
        check_serving(q_client)
    imported = client.import_checkpoint(io.BytesIO(theirs))
    restored = client.create_session(sampling=SAMPLED)
    assert restore_raw(node.address, restored.session_id, imported.checkpoint_id).reprefilled
    # Greedy, so that the draw counters (8 and 0) do not matter: the same history gives the
    # same continuation, bit for bit.
    control = client.create_session()
    tokens = checkpoint_tokens(client, imported.checkpoint_id, tmp_path)
    assert gen(restored, "", 8, sampling=GREEDY) == gen(control, tokens, 8, sampling=GREEDY)
    check_serving(client)


# ---- another KV state version: re-prefill --------------------------------------------------


def _older_state_version(meta: dict[str, Any]) -> None:
    layout = meta["kv_layout"]
    version, rest = layout.split(";", 1)
    assert version == STATE_VERSION, layout
    meta["kv_layout"] = "llama.cpp-seq-state-0;" + rest


def test_another_kv_state_version_imports_and_restores(
    node: InProcessDaemon, client: kvkeep.Client, good_export: bytes
) -> None:
    """A checkpoint whose KV came from another llama.cpp state version is accepted: its KV is
    not used, its tokens are evaluated again, and the session carries on from them."""
    old = client.import_checkpoint(io.BytesIO(edit_export(good_export, _older_state_version)))
    s = client.create_session(sampling=SAMPLED)
    response = restore_raw(node.address, s.session_id, old.checkpoint_id)
    assert response.session.n_tokens == old.n_tokens
    assert len(gen(s, "", 8)) == 8
    fork = client.fork_session(checkpoint_id=old.checkpoint_id)
    assert fork.info().n_tokens == old.n_tokens
    assert len(gen(fork, "", 8)) == 8
    check_serving(client)


# An import of another KV state version keeps the tokens, not the KV: its restore says so.
def test_restoring_another_kv_state_version_reports_reprefilled(
    node: InProcessDaemon, client: kvkeep.Client, good_export: bytes
) -> None:
    old = client.import_checkpoint(io.BytesIO(edit_export(good_export, _older_state_version)))
    s = client.create_session(sampling=SAMPLED)
    assert restore_raw(node.address, s.session_id, old.checkpoint_id).reprefilled


# The re-prefill evaluates the whole history as prompt chunks, while the original evaluated its
# generated tokens one per decode step: exact mode makes both give the same logits.
def test_another_kv_state_version_continues_exactly(
    node: InProcessDaemon, client: kvkeep.Client, good_export: bytes
) -> None:
    expected = gen(client.create_session(sampling=SAMPLED), PROMPT, 24)[8:]
    old = client.import_checkpoint(io.BytesIO(edit_export(good_export, _older_state_version)))
    s = client.create_session(sampling=SAMPLED)
    restore_raw(node.address, s.session_id, old.checkpoint_id)
    assert gen(s, "", 16) == expected
    assert gen(client.fork_session(checkpoint_id=old.checkpoint_id), "", 16) == expected


def test_a_stored_checkpoint_of_another_kv_state_version_restores_with_reprefill(
    node: InProcessDaemon, client: kvkeep.Client, pair: tuple[Saved, Saved]
) -> None:
    """The same, for a checkpoint in the daemon's own store (its manifest rewritten and
    signed again with the store's key, as if an older daemon had written it)."""
    state_dir = node.settings.state_dir
    good, old = pair
    key = (state_dir / "store.key").read_bytes()
    manifest = catalog_manifest(state_dir, old.checkpoint.checkpoint_id)
    set_catalog_manifest(
        state_dir, old.checkpoint.checkpoint_id, remac(edit_manifest(manifest, _older_state_version), key)
    )
    response = restore_raw(node.address, old.session.session_id, old.checkpoint.checkpoint_id)
    assert response.reprefilled
    assert response.session.n_tokens == old.checkpoint.n_tokens
    assert len(gen(old.session, "", 8)) == 8
    fork = old.session.fork(old.checkpoint.checkpoint_id)
    assert len(gen(fork, "", 8)) == 8
    fork.close()
    expect_intact(client, good)


# Saves deduplicate against stored blocks; one that a restore found damaged must not be reused:
# the next checkpoint with the same tokens writes it again and restores.
def test_a_damaged_block_is_not_reused_by_later_checkpoints(
    node: InProcessDaemon, client: kvkeep.Client, pair: tuple[Saved, Saved]
) -> None:
    good, bad = pair
    path = own_blocks(node.settings.state_dir, bad, good)[0]
    flip_bit(path, path.stat().st_size // 2)
    assert_refused(
        lambda: bad.session.restore(bad.checkpoint.checkpoint_id),
        kvkeep.CorruptCheckpointError,
        "block",
    )
    # The same tokens again, in a new session: its checkpoint must be restorable.
    again = saved(client, bad.text, seed=7)
    try:
        again.still_exact()
    finally:
        again.session.close()
