"""Every memory type llama.cpp has, checkpointed with its state and continued exactly.

For each model family: a real sliding-window model (Gemma 3 270M, window 512, prompts that
cross it), and tiny generated models (tests/support/testmodels.py) of a sliding-window architecture
(window 64), a hybrid (LFM2: short convolutions + attention), a recurrent model (Mamba2) and
another plain transformer (Qwen3):

- GetInfo names the memory type and says that checkpoints carry the state;
- a checkpoint restored into another slot, beside other decoding sessions, and a fork of it
  (from its whole state kept in RAM, and from its blocks) continue exactly as one
  uninterrupted call (sampled at temperature 0.8 with a seed), and so does a rollback to it
  while the session holds its cells (cut in place where the memory can be cut);
- a rewind continues exactly as a fresh session given the same history, in a slot and while
  parked; a recurrent state rewinds from the snapshot at the end of the prompt;
- a persistent session resumes exactly after kill -9.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import testmodels
from checkpoint_helpers import (
    GREEDY,
    SAMPLED,
    THREADS,
    Background,
    Trace,
    checkpoint_tokens,
    gen,
    long_text,
    own_daemon,
)
from daemons import DaemonProcess, InProcessDaemon

import kvkeep
from kvkeepd.engine.context import BatchItem
from kvkeepd.engine.engine import Engine
from kvkeepd.sessions.memory.residency import Residency


@dataclass(frozen=True)
class Family:
    name: str
    model: Callable[[], Path]
    memory: str
    sentences: int  # of long_text: enough to cross the sliding window where there is one


FAMILIES = {
    f.name: f
    for f in [
        Family("gemma3-270m", testmodels.gemma3_270m, "iswa", 46),
        Family("gemma3-tiny", lambda: testmodels.path("gemma3"), "iswa", 8),
        Family("lfm2", lambda: testmodels.path("lfm2"), "hybrid", 8),
        Family("mamba2", lambda: testmodels.path("mamba2"), "recurrent", 8),
        Family("qwen3", lambda: testmodels.path("qwen3"), "kv", 8),
    ]
}


@dataclass
class Running:
    family: Family
    path: Path
    daemon: InProcessDaemon
    prompt: str

    def client(self) -> kvkeep.Client:
        return kvkeep.Client(self.daemon.address, timeout=120)


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    family = FAMILIES[request.param]
    path = family.model()
    with own_daemon(tmp_path_factory.mktemp(family.name), model=path, slots=2) as d:
        yield Running(family, path, d, long_text(family.sentences, "lighthouse"))


def one_call(client: kvkeep.Client, prompt: str, n: int) -> Trace:
    s = client.create_session(sampling=SAMPLED)
    try:
        return gen(s, prompt, n)
    finally:
        s.close()


def test_info_names_the_memory_type(fam: Running) -> None:
    with fam.client() as client:
        info = client.info()
    assert info.memory_type == fam.family.memory
    assert info.checkpoints_carry_state, info.state_note
    assert info.mode == "exact"


def test_restore_into_another_slot_beside_other_sessions_is_exact(fam: Running) -> None:
    with fam.client() as client:
        ref = one_call(client, fam.prompt, 24)
        a = client.create_session(sampling=SAMPLED)
        assert gen(a, fam.prompt, 12) == ref[:12]
        ck = a.checkpoint()
        assert gen(a, "", 12) == ref[12:]
        # Back to its own checkpoint while it holds the cells: cut in place where the memory
        # can be cut (no recurrent state), loaded elsewhere; exact either way.
        assert fam.daemon.daemon.manager is not None
        residency = fam.daemon.daemon.manager.residency
        rewinds = residency.rewinds
        a.restore(ck.checkpoint_id)
        assert gen(a, "", 12) == ref[12:]
        in_place = fam.family.memory not in ("recurrent", "hybrid")
        assert residency.rewinds - rewinds == int(in_place)
        others = [client.create_session(sampling=SAMPLED) for _ in range(2)]
        with Background(fam.daemon.address, 1):
            for i, o in enumerate(others):  # both slots change hands: a is parked
                o.complete(f"Other story {i}:", max_tokens=4)
            a.restore(ck.checkpoint_id)
            others[0].complete(f"Other story {i}:", max_tokens=2)
            assert gen(a, "", 12) == ref[12:]
            fork = client.fork_session(checkpoint_id=ck.checkpoint_id)
            assert gen(fork, "", 12) == ref[12:]
            # Loaded from its blocks too, its whole state given up (sessions/whole_states.py).
            fam.daemon.run(_forget_whole_states(residency))
            assembled = client.fork_session(checkpoint_id=ck.checkpoint_id)
            assert gen(assembled, "", 12) == ref[12:]
        for s in [a, fork, assembled, *others]:
            s.close()


async def _forget_whole_states(residency: Residency) -> None:
    residency.wholes.shrink(0)


def test_rewind_continues_like_a_fresh_session(fam: Running) -> None:
    with fam.client() as client:
        s = client.create_session(sampling=GREEDY)
        first = s.complete(fam.prompt, max_tokens=20, sampling=GREEDY)
        n_prompt = first.usage.prompt_tokens
        cut = n_prompt + 6
        s.rewind(cut)
        history = _history(client, s)
        assert len(history) == cut
        again = s.complete(max_tokens=8, logprobs=1, sampling=GREEDY)
        # What was evaluated again to make the rewound state.
        evaluated_again = again.usage.evaluated_tokens
        if fam.family.memory in ("recurrent", "hybrid"):
            assert evaluated_again == 6  # from the snapshot at the end of the prompt
        else:
            assert evaluated_again == 1  # cut in place; the last kept token gives the logits
        control = client.create_session()
        expected = control.complete(history, max_tokens=8, logprobs=1, sampling=GREEDY)
        assert [t.sampled for t in again.logprobs] == [t.sampled for t in expected.logprobs]

        # Parked (both slots taken by others), then rewound: cut from RAM, or evaluated again.
        others = [client.create_session(sampling=SAMPLED) for _ in range(2)]
        for i, o in enumerate(others):
            o.complete(f"Other story {i}:", max_tokens=2)
        assert s.info().residency == "warm"
        s.rewind(cut)
        parked = s.complete(max_tokens=8, logprobs=1, sampling=GREEDY)
        assert [t.sampled for t in parked.logprobs] == [t.sampled for t in expected.logprobs]
        for x in [s, control, *others]:
            x.close()


def _history(client: kvkeep.Client, s: kvkeep.Session) -> list[int]:
    """A session's token history (from a checkpoint's export)."""
    ck = s.checkpoint("history")
    with tempfile.TemporaryDirectory() as tmp:
        tokens = checkpoint_tokens(client, ck.checkpoint_id, Path(tmp))
    client.delete_checkpoint(ck.checkpoint_id)
    return tokens


def test_persistent_session_resumes_exactly_after_kill9(
    fam: Running, spawn_daemon: Callable[..., DaemonProcess]
) -> None:
    # Every turn saves its head (not only a journal record): the resumed state is read back.
    d = spawn_daemon(
        "--model", str(fam.path), "--threads", str(THREADS), "--slots", "2", "--head-interval", "1"
    )
    with kvkeep.Client(d.address, timeout=120) as client:
        ref = one_call(client, fam.prompt, 24)
        s = client.create_session(sampling=SAMPLED, persistent=True)
        assert gen(s, fam.prompt, 12) == ref[:12]
    d.restart(kill=True)
    with kvkeep.Client(d.address, timeout=120) as client:
        s = client.session(s.session_id)
        assert s.info().residency == "cold"
        resumed = s.complete(max_tokens=12, logprobs=1)
        assert [(t.sampled.token_id, t.sampled.logprob) for t in resumed.logprobs] == ref[12:]
        # From its stored state (the last sampled token is evaluated), not from its history.
        assert resumed.usage.evaluated_tokens == 1


def test_a_layout_kvkeep_does_not_know_is_refused_by_discovery(fam: Running) -> None:
    """The daemon keeps such a model's token history only (GetInfo says why): discovery
    refuses any state it cannot account for byte by byte."""
    from kvkeepd.state.cells import discover, parse
    from kvkeepd.state.layout import StateFormatError

    engine = fam.daemon.daemon.engine if fam.daemon.daemon else None
    assert engine is not None and engine.layout is not None and engine.info is not None
    info = engine.info

    async def probe_state() -> bytes:
        def run(e: Engine) -> bytes:
            e.ctx.decode([BatchItem(0, info.bos_token, 0, False)])
            try:
                return bytes(e.ctx.state_bytes(0))
            finally:
                e.ctx.clear(0)

        return await asyncio.wrap_future(engine.call(run))

    blob = fam.daemon.run(probe_state())
    kinds = {"recurrent": info.memory == "recurrent", "hybrid": info.memory.startswith("hybrid")}
    assert discover(blob, window=info.n_swa, **kinds) == engine.layout
    parse(blob, engine.layout)
    for bad in (blob + b"\0\0\0\0", blob[:-4], blob[:8] + b"\xff" * 4 + blob[12:]):
        with pytest.raises(StateFormatError):
            discover(bad, window=info.n_swa, **kinds)


def test_a_shared_system_prompt_is_attached_exactly(fam: Running) -> None:
    """A second session with the same system prompt attaches its first blocks (for sliding
    windows and recurrent state: the snapshot at the prompt's last block boundary)."""
    with fam.client() as client:
        first = client.create_session(fam.prompt, sampling=SAMPLED)
        a = first.complete(" Go on:", max_tokens=8, logprobs=1)
        assert a.usage.reused_tokens == 0
        second = client.create_session(fam.prompt, sampling=SAMPLED)
        b = second.complete(" Go on:", max_tokens=8, logprobs=1)
        assert b.usage.reused_tokens >= 64
        assert [t.sampled for t in b.logprobs] == [t.sampled for t in a.logprobs]
        first.close()
        second.close()


def test_the_prefix_cache_survives_a_restart(
    fam: Running, spawn_daemon: Callable[..., DaemonProcess]
) -> None:
    # The turn saves its head, so its blocks are on disk when the daemon is killed.
    d = spawn_daemon(
        "--model", str(fam.path), "--threads", str(THREADS), "--slots", "2", "--head-interval", "1"
    )
    with kvkeep.Client(d.address, timeout=120) as client:
        first = client.create_session(fam.prompt, sampling=SAMPLED, persistent=True)
        a = first.complete(" Go on:", max_tokens=8, logprobs=1)
    d.restart(kill=True)
    with kvkeep.Client(d.address, timeout=120) as client:
        b = client.create_session(fam.prompt, sampling=SAMPLED).complete(" Go on:", max_tokens=8, logprobs=1)
        assert b.usage.reused_tokens >= 64  # from disk
        assert [t.sampled for t in b.logprobs] == [t.sampled for t in a.logprobs]
