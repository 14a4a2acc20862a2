"""Checkpoints: exact resume, persistence, delta and dedup, the SDK and the CLI.

Exactness is checked with sampled decoding (temperature 0.8, a fixed seed) wherever the RNG
allows it: a session's draw i takes its uniform from (seed, i), so two sessions with the same
seed, the same history and the same draw counter must produce the same token ids. ``gen``
returns each token's log-probability too, so "the same" means bit-identical logits, not only
tokens. Exactness checks run while other sessions decode in the same daemon (``Background``).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from checkpoint_helpers import (
    GREEDY,
    PROMPT,
    SAMPLED,
    SPAWN_ARGS,
    THREADS,
    Background,
    Trace,
    block_files,
    checkpoint_tokens,
    gen,
    ids,
    listing,
    long_text,
    own_daemon,
)
from click.testing import CliRunner
from daemons import DaemonProcess, InProcessDaemon

import kvkeep
from kvkeep.cli import main as cli_main
from kvkeepd.sessions.placement import InSlot


@pytest.fixture(scope="module")
def daemon1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """This module's shared daemon: the conftest defaults, but one llama.cpp thread."""
    with own_daemon(tmp_path_factory.mktemp("state")) as d:
        yield d


@pytest.fixture
def client1(daemon1: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(daemon1.address, timeout=60) as c:
        yield c


def one_call(client: kvkeep.Client, n: int, prompt: str = PROMPT) -> Trace:
    """The reference: ``n`` tokens of PROMPT in one call of a fresh session with SAMPLED."""
    ref_session = client.create_session(sampling=SAMPLED)
    try:
        return gen(ref_session, prompt, n)
    finally:
        ref_session.close()


# ---- exact resume ----------------------------------------------------------------------------


def test_resume_after_kill9_continues_like_one_call(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    """32 tokens in one call == 16, checkpoint, kill -9, restart, 16 more (empty prompt); and
    the checkpoint, restored or forked after the restart, continues the same way."""
    proc = spawn_daemon(*SPAWN_ARGS)
    with kvkeep.Client(proc.address, timeout=60) as client, Background(proc.address, 2):
        ref = one_call(client, 32)
        s = client.create_session(sampling=SAMPLED, persistent=True)
        assert gen(s, PROMPT, 16) == ref[:16]
        ck = s.checkpoint("half")
        n_tokens = s.info().n_tokens
        assert ck.n_tokens == n_tokens

    assert proc.kill() == -9
    proc.start()

    with kvkeep.Client(proc.address, timeout=60) as client, Background(proc.address, 2):
        assert s.session_id in {i.session_id for i in client.list_sessions()}
        resumed = client.session(s.session_id)
        info = resumed.info()
        assert info.n_tokens == n_tokens
        assert info.persistent
        assert gen(resumed, "", 16) == ref[16:]

        assert [c.checkpoint_id for c in resumed.checkpoints()] == [ck.checkpoint_id]
        assert resumed.restore(ck.checkpoint_id).n_tokens == n_tokens
        assert gen(resumed, "", 16) == ref[16:]

        fork = resumed.fork(ck.checkpoint_id)
        assert gen(fork, "", 16) == ref[16:]


@pytest.mark.parametrize("persistent", [False, True], ids=["ephemeral", "persistent"])
def test_a_rollback_to_its_own_checkpoint_cuts_the_cells_it_holds(
    daemon1: InProcessDaemon, client1: kvkeep.Client, persistent: bool
) -> None:
    """Restoring one of the session's own checkpoints while the session still holds its
    cells loads nothing (the slot is cut) and continues as the uninterrupted run did; once
    another state was loaded, the same restore loads."""
    assert daemon1.daemon.manager is not None
    residency, ledger = daemon1.daemon.manager.residency, daemon1.daemon.manager.ledger
    s = client1.create_session(sampling=SAMPLED, persistent=persistent)
    other = client1.create_session(sampling=SAMPLED, persistent=persistent)
    gen(s, PROMPT, 8)
    ck = s.checkpoint()
    after = gen(s, "", 12)
    rewinds, swap_ins = residency.rewinds, ledger.total.swap_ins
    for _ in range(2):
        assert s.restore(ck.checkpoint_id).n_tokens == ck.n_tokens
        assert gen(s, "", 12) == after
    assert (residency.rewinds, ledger.total.swap_ins) == (rewinds + 2, swap_ins)

    gen(other, "Another story:", 4)
    s.restore(other.checkpoint().checkpoint_id)
    gen(s, "", 2)
    s.restore(ck.checkpoint_id)
    assert gen(s, "", 12) == after
    assert (residency.rewinds, ledger.total.swap_ins) == (rewinds + 2, swap_ins + 2)
    for x in (s, other):
        x.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["ephemeral", "persistent"])
def test_restore_generates_the_same_tokens_again(
    daemon1: InProcessDaemon, client1: kvkeep.Client, persistent: bool
) -> None:
    with Background(daemon1.address, 3):
        ref = one_call(client1, 48)
        s = client1.create_session(sampling=SAMPLED, persistent=persistent)
        assert gen(s, PROMPT, 8) == ref[:8]
        ck8 = s.checkpoint("eight")
        assert gen(s, "", 16) == ref[8:24]
        ck24 = s.checkpoint("twenty-four")

        # Roll back and go again: twice, then past the later checkpoint.
        for _ in range(2):
            assert s.restore(ck8.checkpoint_id).n_tokens == ck8.n_tokens
            assert gen(s, "", 16) == ref[8:24]
        assert gen(s, "", 8) == ref[24:32]
        # Forward again: to the later checkpoint, then back to the earlier one.
        assert s.restore(ck24.checkpoint_id).n_tokens == ck24.n_tokens
        assert gen(s, "", 24) == ref[24:48]
        s.restore(ck8.checkpoint_id)
        assert gen(s, "", 40) == ref[8:48]
        s.close()


def test_fork_continues_like_its_parent(daemon1: InProcessDaemon, client1: kvkeep.Client) -> None:
    with Background(daemon1.address, 3):
        ref = one_call(client1, 32)
        parent = client1.create_session(sampling=SAMPLED, persistent=True)
        assert gen(parent, PROMPT, 8) == ref[:8]
        from_state = parent.fork()
        ck = parent.checkpoint()
        from_checkpoint = parent.fork(ck.checkpoint_id, persistent=True)
        fork_of_fork = from_state.fork()

        assert gen(parent, "", 24) == ref[8:32]
        for child in (from_state, from_checkpoint, fork_of_fork):
            assert child.session_id != parent.session_id
            assert child.info().n_tokens == ck.n_tokens
            assert gen(child, "", 24) == ref[8:32]
        assert from_checkpoint.info().persistent
        assert not from_state.info().persistent
        for s in (parent, from_state, from_checkpoint, fork_of_fork):
            s.close()


def test_exact_when_the_state_lands_in_another_slot(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    """slots=2 and more sessions than slots: a session is evicted (parked in RAM), comes back
    in the other slot, is restored while parked, and always continues exactly."""
    d = start_daemon(slots=2, threads=THREADS)
    assert d.daemon is not None and d.daemon.manager is not None
    manager = d.daemon.manager

    def slot_of(s: kvkeep.Session) -> int | None:
        where = manager.residency.where(manager.sessions[s.session_id])
        return where.slot if isinstance(where, InSlot) else None

    with kvkeep.Client(d.address, timeout=60) as client:
        ref = one_call(client, 40)
        a = client.create_session(sampling=SAMPLED)
        b = client.create_session(sampling=SAMPLED)
        c = client.create_session(sampling=SAMPLED)
        assert gen(a, PROMPT, 16) == ref[:16]
        first_slot = slot_of(a)
        assert first_slot is not None
        ck = a.checkpoint()

        gen(b, "Bees build", 4)  # the free slot
        gen(c, "Cats climb", 4)  # evicts a, the least recently used
        assert a.info().residency == "warm"
        assert gen(a, "", 8) == ref[16:24]  # evicts b: a is now in the other slot
        assert slot_of(a) not in (None, first_slot)

        # Restore while b and c hold both slots (a's state is parked), then make c the least
        # recently used, so that the restored state lands in c's slot: not the one it was
        # checkpointed from.
        gen(b, "", 4)  # evicts c (b is now in the first slot)
        gen(c, "", 4)  # evicts a (c is now in the other slot)
        assert a.info().residency == "warm"
        a.restore(ck.checkpoint_id)
        gen(b, "", 2)
        assert gen(a, "", 24) == ref[16:40]  # evicts c
        assert slot_of(a) not in (None, first_slot)

        # Churn with a third, always-busy session: a is parked and resumed again and again.
        with Background(d.address, 1):
            for i in range(3):
                a.restore(ck.checkpoint_id)
                gen(b, "", 3)
                gen(c, "", 3)
                fork = a.fork()
                assert gen(a, "", 8) == ref[16:24], f"round {i}"
                assert gen(fork, "", 8) == ref[16:24], f"round {i} (fork)"
                fork.close()
        assert manager.ledger.total.swap_ins > 0


def test_rewind_continues_like_the_session_that_never_went_further(
    daemon1: InProcessDaemon, client1: kvkeep.Client, tmp_path: Path
) -> None:
    """Greedy (the RNG plays no part). Rewound into its generated tokens, a session continues
    exactly as its first run did past that point: that first run is the session that never
    went further. Rewound into its prompt, it continues exactly like a fresh session given the
    kept prompt tokens as token ids (both evaluated the kept tokens as one prompt chunk), and
    fed the rest of the prompt it generates its first run again."""
    with Background(daemon1.address, 2):
        a = client1.create_session(sampling=GREEDY)
        g = gen(a, PROMPT, 32)
        n_prompt = a.info().n_tokens - 32
        keep = n_prompt + 12
        assert a.rewind(keep).n_tokens == keep
        assert gen(a, "", 20) == g[12:]
        history = checkpoint_tokens(client1, a.checkpoint().checkpoint_id, tmp_path)
        assert history[n_prompt:] == ids(g)

        assert a.rewind(n_prompt - 3).n_tokens == n_prompt - 3
        again = gen(a, "", 8)
        fresh = client1.create_session(sampling=GREEDY)
        assert gen(fresh, history[: n_prompt - 3], 8) == again

        a.rewind(n_prompt - 3)
        assert gen(a, history[n_prompt - 3 : n_prompt], 32) == g
        for s in (a, fresh):
            s.close()


# A generated token is evaluated alone (one decode step); fed back as a prompt it is evaluated
# inside a chunk. Exact mode requires both to give the same logits (llama.cpp built without
# its tinyBLAS kernels, which serve only products of 2+ columns).
def test_rewind_greedy_continues_like_a_fresh_session_given_the_kept_tokens(
    daemon1: InProcessDaemon, client1: kvkeep.Client, tmp_path: Path
) -> None:
    """The strongest comparison: greedy, a session rewound to prompt + 12 generated tokens
    continues exactly like a fresh session given those tokens as prompt token ids."""
    a = client1.create_session(sampling=GREEDY)
    g = gen(a, PROMPT, 32)
    n_prompt = a.info().n_tokens - 32
    keep = n_prompt + 12
    a.rewind(keep)
    cont = gen(a, "", 20)
    assert cont == g[12:]
    history = checkpoint_tokens(client1, a.checkpoint().checkpoint_id, tmp_path)
    fresh = client1.create_session(sampling=GREEDY)
    try:
        got = gen(fresh, history[:keep], 20)
        assert ids(got) == ids(cont)
        assert got == cont
    finally:
        a.close()
        fresh.close()


def test_rewind_sampled_continues_like_a_session_with_the_same_draw_count(
    daemon1: InProcessDaemon, client1: kvkeep.Client, tmp_path: Path
) -> None:
    """A session's draw counter counts every token it sampled, and Rewind keeps it (Rewind
    truncates history, not the RNG stream). So a session that sampled 32 tokens and is rewound
    to prompt + 16 draws its next tokens with indexes 32, 33, ...; a session that never went
    past prompt + 16 would use 16, 17, ... and legitimately differ. Its twin is a session with
    the same seed that made the same 32 draws and was rewound to the same point: both
    truncated the same KV in place and must agree token for token and logit for logit. (The greedy
    test above checks the stronger property: a twin fed the kept history as prompt ids.)"""
    with Background(daemon1.address, 2):
        a = client1.create_session(sampling=SAMPLED)
        g = gen(a, PROMPT, 32)
        n_prompt = a.info().n_tokens - 32
        keep = n_prompt + 16
        a.rewind(keep)
        cont = gen(a, "", 16)  # draws 32..47

        twin = client1.create_session(sampling=SAMPLED)
        assert gen(twin, PROMPT, 16) == g[:16]
        assert gen(twin, "", 16) == g[16:]  # 32 draws, as a made, in two calls
        twin.rewind(keep)
        assert gen(twin, "", 16) == cont

        # A rewound session that is checkpointed, restored and forked keeps its draw count.
        a.rewind(keep)
        ck = a.checkpoint()
        more = gen(a, "", 16)  # draws 48..63
        a.restore(ck.checkpoint_id)
        assert gen(a, "", 16) == more
        assert gen(a.fork(ck.checkpoint_id), "", 16) == more
        history = checkpoint_tokens(client1, ck.checkpoint_id, tmp_path)
        assert history[n_prompt:] == ids(g[:16])
        for s in (a, twin):
            s.close()


# ---- persistent vs ephemeral -----------------------------------------------------------------


def test_persistent_sessions_survive_kill9_and_sigterm_ephemeral_ones_do_not(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    proc = spawn_daemon(*SPAWN_ARGS)
    with kvkeep.Client(proc.address, timeout=60) as client:
        p = client.create_session("You are a lighthouse keeper.", sampling=SAMPLED, persistent=True)
        e = client.create_session("You are a lighthouse keeper.", sampling=SAMPLED)
        gen(p, PROMPT, 8)
        gen(e, PROMPT, 8)
        # How p continues: from the middle of a sentence, which the model does not end at once.
        ref = gen(p.fork(), " Then he", 16)
        before = p.info()
        assert not p.checkpoints()

    for kill in (True, False):
        proc.restart(kill=kill)
        with kvkeep.Client(proc.address, timeout=60) as client:
            listed = {i.session_id: i for i in client.list_sessions()}
            assert e.session_id not in listed
            with pytest.raises(kvkeep.NotFoundError):
                client.session(e.session_id)
            info = listed[p.session_id]
            assert info.persistent
            assert info.n_tokens == before.n_tokens
            assert info.messages == before.messages
            assert info.sampling == before.sampling
            assert info.created_at == pytest.approx(before.created_at)
            p = client.session(p.session_id)
            prompt, half = (" Then he", ref[:8]) if kill else ("", ref[8:])
            assert gen(p, prompt, 8) == half
            before = p.info()


def test_autosave_happens_before_the_final_chunk(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    """Kill -9 the daemon the moment the last chunk of a generation arrives: the whole
    generation survived."""
    proc = spawn_daemon(*SPAWN_ARGS)
    with kvkeep.Client(proc.address, timeout=60) as client:
        p = client.create_session(sampling=SAMPLED, persistent=True)
        gen(p, PROMPT, 4)
        ref = gen(p.fork(), "", 20)
        n0 = p.info().n_tokens
        got: list[int] = []
        stream = p.generate("", max_tokens=12)
        for chunk in stream:
            got += chunk.token_ids
            if chunk.finish_reason is not None:
                proc.kill()
                break
        stream.close()
        assert got == ids(ref[:12])

    proc.start()
    with kvkeep.Client(proc.address, timeout=60) as client:
        p = client.session(p.session_id)
        assert p.info().n_tokens == n0 + 12
        assert gen(p, "", 8) == ref[12:]


def test_a_killed_generation_resumes_from_the_last_completed_save(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    proc = spawn_daemon(*SPAWN_ARGS)
    with kvkeep.Client(proc.address, timeout=60) as client:
        p = client.create_session(sampling=SAMPLED, persistent=True)
        gen(p, PROMPT, 4)
        ref = gen(p.fork(), "", 8)
        n0 = p.info().n_tokens
        stream = p.generate("", max_tokens=300)
        first = next(stream)
        assert first.finish_reason is None
        proc.kill()
        with pytest.raises(kvkeep.KvkeepError):
            for _ in stream:
                pass

    proc.start()
    with kvkeep.Client(proc.address, timeout=60) as client:
        p = client.session(p.session_id)
        assert p.info().n_tokens == n0
        assert gen(p, "", 8) == ref


def test_ephemeral_sessions_never_touch_the_disk(
    start_daemon: Callable[..., InProcessDaemon], tmp_path: Path
) -> None:
    d = start_daemon(threads=THREADS)
    state_dir = d.settings.state_dir
    with kvkeep.Client(d.address, timeout=60) as client:
        client.info()
        baseline = listing(state_dir)
        assert baseline, "the daemon made its state directory at start"

        s = client.create_session("You are a cartographer.", sampling=SAMPLED)
        s.complete(PROMPT, max_tokens=8)
        s.chat("Name a river.", max_tokens=6)
        ck = s.checkpoint("mem")
        assert [c.checkpoint_id for c in s.checkpoints()] == [ck.checkpoint_id]
        f1 = s.fork()
        f2 = s.fork(ck.checkpoint_id)
        f1.complete("More.", max_tokens=4)
        f2.complete("More.", max_tokens=4)
        f2.checkpoint()
        s.rewind(4)
        s.restore(ck.checkpoint_id)
        s.complete("More.", max_tokens=4)
        client.export_checkpoint(ck.checkpoint_id, tmp_path / "mem.kvst")
        ck2 = s.checkpoint()
        client.delete_checkpoint(ck2.checkpoint_id)
        for x in (f1, f2, s):
            x.close()
        assert client.list_sessions() == []

        assert listing(state_dir) == baseline


# ---- delta and dedup ----------------------------------------------------------------------


#: Raw text after a long system prompt, continuing its pattern (rather than ending the turn).
NEXT = " Note 75: the amber lantern rests near"


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """A daemon with 2048-token sessions, for ~1,000-token system prompts."""
    with own_daemon(tmp_path_factory.mktemp("big"), ctx_per_session=2048) as d:
        yield d


def test_a_second_checkpoint_writes_only_new_blocks(big: InProcessDaemon) -> None:
    system = "Delta test. " + long_text(75, "delta")
    with kvkeep.Client(big.address, timeout=120) as client:
        # Ephemeral: its explicit checkpoints are the only writes, so bytes_written is the delta.
        s = client.create_session(system, sampling=SAMPLED)
        gen(s, NEXT, 4)
        n = s.info().n_tokens
        assert n >= 900
        c1 = s.checkpoint()
        assert c1.bytes_written >= 0.95 * c1.bytes_referenced
        gen(s, "", 64)
        c2 = s.checkpoint()
        assert c2.bytes_referenced > c1.bytes_referenced
        per_token = c2.bytes_referenced / c2.n_tokens
        # New: the old partial tail re-cut, and the blocks after it; at most 64 + 2 x 64 cells.
        assert c2.bytes_written <= 3 * 64 * per_token
        assert c2.bytes_written < 0.25 * c2.bytes_referenced
        c3 = s.checkpoint()  # nothing new: the manifest alone
        assert c3.bytes_written < 0.01 * c3.bytes_referenced
        s.close()

        # Persistent: the autosaves write the blocks, so count the files they add.
        state_dir = big.settings.state_dir
        p = client.create_session(system, sampling=SAMPLED, persistent=True)
        gen(p, NEXT, 4)
        files1 = block_files(state_dir)
        assert len(files1) >= math.ceil(n / 64) - 1
        gen(p, "", 64)
        files2 = block_files(state_dir)
        assert set(files1) <= set(files2)
        assert len(files2) - len(files1) <= 3
        p.close()


def test_a_shared_system_prompt_is_stored_once(big: InProcessDaemon) -> None:
    system = "Dedup test. " + long_text(75, "dedup")
    state_dir = big.settings.state_dir
    with kvkeep.Client(big.address, timeout=120) as client:
        before = block_files(state_dir)
        p1 = client.create_session(
            system, sampling=kvkeep.SamplingParams(temperature=0.8, seed=1), persistent=True
        )
        assert block_files(state_dir) == before  # saved on creation, but no KV yet
        gen(p1, NEXT, 4)
        after1 = block_files(state_dir)
        n_shared = p1.info().n_tokens - 4  # the system prompt and NEXT
        new1 = set(after1) - set(before)
        assert len(new1) >= n_shared // 64 >= 14

        p2 = client.create_session(
            system, sampling=kvkeep.SamplingParams(temperature=0.8, seed=2), persistent=True
        )
        gen(p2, NEXT, 4)
        after2 = block_files(state_dir)
        new2 = set(after2) - set(after1)
        # Only the blocks past the shared prefix are new (the one where the generated tokens
        # start, and the tail after it); the blocks of the system prompt are reused.
        assert len(new2) <= 2
        ck2 = p2.checkpoint()
        new_bytes = sum(after2[k].stat().st_size for k in new2)
        assert new_bytes < 0.2 * ck2.bytes_referenced

        # The shared blocks serve p2 exactly.
        ref = gen(p2, "", 8)
        p2.restore(ck2.checkpoint_id)
        assert gen(p2, "", 8) == ref
        p1.close()
        p2.close()


# ---- SDK and CLI ----------------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True], ids=["ephemeral", "persistent"])
def test_sdk_checkpoints_export_and_import(
    client1: kvkeep.Client,
    start_daemon: Callable[..., InProcessDaemon],
    tmp_path: Path,
    persistent: bool,
) -> None:
    s = client1.create_session(sampling=SAMPLED, persistent=persistent)
    gen(s, PROMPT, 8)
    c1 = s.checkpoint("first")
    ref = gen(s, "", 16)
    c2 = s.checkpoint()
    assert (c1.label, c2.label) == ("first", None)
    assert c1.session_id == c2.session_id == s.session_id
    assert c2.n_tokens == c1.n_tokens + 16
    assert c1.checkpoint_id.startswith("c_")
    assert 0 < c1.bytes_written <= c1.bytes_referenced
    assert [c.checkpoint_id for c in s.checkpoints()] == [c1.checkpoint_id, c2.checkpoint_id]
    assert client1.list_checkpoints(s.session_id) == s.checkpoints()
    info = s.info()
    assert info.n_checkpoints == 2
    if persistent:
        assert info.head_checkpoint_id not in (None, c1.checkpoint_id, c2.checkpoint_id)
        with pytest.raises(kvkeep.CheckpointInUseError):
            client1.delete_checkpoint(info.head_checkpoint_id)

    restored = s.restore(c1.checkpoint_id)
    assert restored.session_id == s.session_id
    assert restored.n_tokens == c1.n_tokens
    assert gen(s, "", 16) == ref

    # Export to a path and to a file object: the same bytes.
    path = tmp_path / "c1.kvst"
    written = client1.export_checkpoint(c1.checkpoint_id, path)
    buf = io.BytesIO()
    assert client1.export_checkpoint(c1.checkpoint_id, buf) == written == path.stat().st_size
    assert buf.getvalue() == path.read_bytes()

    # Import here (from a path) and in another daemon (from a file object): both continue exactly.
    imported = client1.import_checkpoint(path)
    assert imported.checkpoint_id != c1.checkpoint_id
    assert imported.n_tokens == c1.n_tokens
    assert gen(client1.fork_session(checkpoint_id=imported.checkpoint_id), "", 16) == ref
    other = start_daemon(threads=THREADS)
    with kvkeep.Client(other.address, timeout=60) as other_client:
        there = other_client.import_checkpoint(io.BytesIO(path.read_bytes()))
        assert there.n_tokens == c1.n_tokens
        assert gen(other_client.fork_session(checkpoint_id=there.checkpoint_id), "", 16) == ref

    client1.delete_checkpoint(c2.checkpoint_id)
    assert [c.checkpoint_id for c in s.checkpoints()] == [c1.checkpoint_id]
    with pytest.raises(kvkeep.NotFoundError):
        s.restore(c2.checkpoint_id)
    with pytest.raises(kvkeep.NotFoundError):
        client1.delete_checkpoint(c2.checkpoint_id)
    with pytest.raises(kvkeep.InvalidRequestError):
        s.restore("not-a-checkpoint")
    s.close()


def test_cli_checkpoint_and_fork_commands(
    daemon1: InProcessDaemon, client1: kvkeep.Client, tmp_path: Path
) -> None:
    runner = CliRunner()

    def cli(*args: str, ok: bool = True) -> str:
        result = runner.invoke(cli_main, ["--address", daemon1.address, "--timeout", "60", *args])
        if ok:
            assert result.exit_code == 0, (args, result.stdout, result.stderr, result.exception)
        else:
            assert result.exit_code == 1, (args, result.stdout, result.stderr)
            assert result.stderr.startswith("error: ")
        return result.stdout.strip()

    sid = cli("session", "create", "--persistent", "--temperature", "0.8", "--seed", str(SAMPLED.seed))
    s = client1.session(sid)
    assert s.info().persistent
    gen(s, PROMPT, 8)

    ck = cli("checkpoint", "create", sid, "--label", "from-cli")
    assert ck.startswith("c_")
    listed = cli("checkpoint", "list", sid)
    assert ck in listed and "from-cli" in listed
    as_json = json.loads(cli("--json", "checkpoint", "list", sid))
    assert [c["checkpoint_id"] for c in as_json] == [ck]
    assert as_json[0]["label"] == "from-cli"
    ref = gen(s, "", 16)

    cli("checkpoint", "restore", sid, ck)
    assert gen(s, "", 16) == ref
    restored = json.loads(cli("--json", "checkpoint", "restore", sid, ck))
    assert restored["n_tokens"] == client1.list_checkpoints(sid)[0].n_tokens

    forked = cli("session", "fork", sid, "--checkpoint", ck)
    assert forked.startswith("s_") and forked != sid
    assert gen(client1.session(forked), "", 16) == ref
    forked_now = cli("session", "fork", sid, "--persistent")
    assert client1.session(forked_now).info().persistent
    assert gen(client1.session(forked_now), "", 16) == gen(s, "", 16)

    path = tmp_path / "cli.kvst"
    assert "wrote" in cli("checkpoint", "export", ck, str(path))
    assert path.stat().st_size > 0
    imported = cli("checkpoint", "import", str(path))
    assert imported.startswith("c_") and imported != ck
    fork_of_import = cli("session", "fork", sid, "--checkpoint", imported)
    assert gen(client1.session(fork_of_import), "", 16) == ref

    cli("checkpoint", "delete", ck)
    assert ck not in cli("checkpoint", "list", sid)
    cli("checkpoint", "restore", sid, ck, ok=False)
    cli("checkpoint", "delete", ck, ok=False)
    for x in (sid, forked, forked_now, fork_of_import):
        client1.session(x).close()
