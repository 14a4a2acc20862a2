"""Fast mode (`--flash-attn`): flash attention with f16 K/V, reported as `compact`.

- `--flash-attn` is a setting like any other, and leaves exact mode;
- llama.cpp's own flash attention gives logits that depend on the batch's shape, and the
  start-up probe finds it: tests/daemon/test_exact_flash.py, in a process of its own (the
  tests' processes run flash attention's batch-invariant kernels, exact mode's);
- a checkpoint restores the KV it was made from: restored in place, forked, or restored
  after a restart, a session continues exactly as the live one did (each running alone, so
  that the batches have the same shapes);
- the prefix cache attaches in fast mode too;
- compact and exact states never stand for each other: a checkpoint of one mode restores in
  the other by evaluating its tokens again, also from `--kv-unified`, whose bytes have the
  exact mode's layout.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from checkpoint_helpers import (
    GREEDY,
    PROMPT,
    SAMPLED,
    SPAWN_ARGS,
    export_bytes,
    gen,
    long_text,
    restore_raw,
)
from daemons import DaemonProcess, InProcessDaemon

import kvkeep
from kvkeepd.config import resolution
from kvkeepd.engine.probes import PROBE_BESIDE, PROBE_SINGLES, probe_plan

#: Over 256 tokens: the KV view of a sequence grows to 512 cells there, where flash
#: attention's single-query kernel changes.
LONG_PROMPT = long_text(24)


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("fast"), flash_attn=True, slots=2)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def fast_client(fast: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(fast.address, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    ("flags", "environ", "origin"),
    [({"flash_attn": "true"}, {}, "flag --flash-attn"), ({}, {"KVKEEP_FLASH_ATTN": "on"}, "environment")],
)
def test_flash_attn_is_a_setting_that_leaves_exact_mode(
    flags: dict[str, str], environ: dict[str, str], origin: str
) -> None:
    resolved = resolution.resolve(flags, environ)
    assert resolved.settings.flash_attn and not resolved.settings.exact
    line = next(x for x in resolved.describe().splitlines() if x.startswith("flash-attn"))
    assert line.startswith("flash-attn = true") and origin in line
    assert resolution.resolve({}, {}).settings.exact


@pytest.mark.parametrize(("n", "batch"), [(260, 512), (256, 512), (260, 32)])
def test_the_probe_plan_reaches_every_kernel_choice(n: int, batch: int) -> None:
    plan = probe_plan(n, batch)
    assert sum(plan) == n and max(plan) <= batch
    assert plan[-PROBE_SINGLES:] == [1] * PROBE_SINGLES and PROBE_BESIDE <= PROBE_SINGLES
    chunks = [c for c in plan if c > 1]
    assert plan[0] == 1 and any(c < 8 for c in chunks) and any(8 <= c < 64 for c in chunks)
    if batch >= 64:
        assert any(c >= 64 for c in chunks)


def test_fast_mode_is_compact_with_f16_kv(fast_client: kvkeep.Client, client: kvkeep.Client) -> None:
    fast_info = fast_client.info()
    assert (fast_info.mode, fast_info.kv_type) == ("compact", "f16")
    info = client.info()  # the shared daemon: exact settings, and its probe passed
    assert (info.mode, info.kv_type) == ("exact", "f16")


def test_a_checkpoint_restores_the_state_it_was_made_from(
    fast: InProcessDaemon, fast_client: kvkeep.Client
) -> None:
    s = fast_client.create_session(sampling=SAMPLED)
    gen(s, LONG_PROMPT, 4)
    assert s.info().n_tokens > 256
    ck = s.checkpoint()
    live = gen(s, "", 8)
    response = restore_raw(fast.address, s.session_id, ck.checkpoint_id)
    assert not response.reprefilled
    assert gen(s, "", 8) == live
    twin = fast_client.fork_session(checkpoint_id=ck.checkpoint_id)
    assert gen(twin, "", 8) == live
    s.close()
    twin.close()


def test_the_prefix_cache_attaches_in_fast_mode(fast_client: kvkeep.Client) -> None:
    system = long_text(12, topic="orchard")
    first = fast_client.create_session(system, sampling=GREEDY)
    first.chat("Name a fruit.", max_tokens=4)
    second = fast_client.create_session(system, sampling=GREEDY)
    reply = second.chat("Name a tree.", max_tokens=4)
    assert reply.usage.reused_tokens >= 64
    assert reply.usage.evaluated_tokens < second.info().n_tokens - 64
    first.close()
    second.close()


def test_a_restart_restores_stored_state_in_fast_mode(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    d = InProcessDaemon.with_settings(state_dir, flash_attn=True, slots=1)
    try:
        with kvkeep.Client(d.address, timeout=60) as c:
            s = c.create_session(persistent=True, sampling=SAMPLED)
            gen(s, PROMPT, 4)
            ck = s.checkpoint()
            live = gen(s, "", 8)
    finally:
        d.stop()
    d = InProcessDaemon.with_settings(state_dir, flash_attn=True, slots=1)
    try:
        with kvkeep.Client(d.address, timeout=60) as c:
            response = restore_raw(d.address, s.session_id, ck.checkpoint_id)
            assert not response.reprefilled
            assert gen(c.session(s.session_id), "", 8) == live
    finally:
        d.stop()


def test_a_persistent_session_continues_after_kill9_in_fast_mode(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    """Its acknowledged turns survive the kill; what the store did not hold of its state is
    evaluated again from its tokens (in compact mode: close to the original, not equal)."""
    d = spawn_daemon(*SPAWN_ARGS, "--slots", "1", "--flash-attn")
    with kvkeep.Client(d.address, timeout=60) as c:
        s = c.create_session("You are terse.", persistent=True, sampling=GREEDY)
        s.chat("Name a colour.", max_tokens=8)
        s.chat("And another one.", max_tokens=8)
        n_tokens = s.info().n_tokens
    d.restart(kill=True)
    with kvkeep.Client(d.address, timeout=60) as c:
        assert c.info().mode == "compact"
        again = c.session(s.session_id)
        assert again.info().n_tokens == n_tokens
        reply = again.chat("One more.", max_tokens=4)
        assert reply.finish_reason in ("length", "eos")
        assert again.info().n_tokens > n_tokens


@pytest.mark.parametrize("compact", ["flash-attn", "kv-unified"])
def test_compact_state_and_exact_state_never_stand_for_each_other(
    compact: str,
    daemon: InProcessDaemon,
    client: kvkeep.Client,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    """Either way, a checkpoint of the other mode restores by evaluating its tokens again.
    One shared KV buffer keeps the exact mode's byte layout: only the mode tells them apart."""
    other = request.getfixturevalue("fast") if compact == "flash-attn" else start_daemon(kv_unified=True)
    with kvkeep.Client(other.address, timeout=60) as other_client:
        assert other_client.info().mode == "compact"
        s = other_client.create_session(sampling=SAMPLED)
        gen(s, PROMPT, 4)
        theirs = export_bytes(other_client, s.checkpoint().checkpoint_id, tmp_path / "compact.kvst")
        mine = client.create_session(sampling=SAMPLED)
        gen(mine, PROMPT, 4)
        ours = export_bytes(client, mine.checkpoint().checkpoint_id, tmp_path / "exact.kvst")
        for to, address, data in ((client, daemon.address, theirs), (other_client, other.address, ours)):
            imported = to.import_checkpoint(io.BytesIO(data))
            restored = to.create_session(sampling=SAMPLED)
            assert restore_raw(address, restored.session_id, imported.checkpoint_id).reprefilled
            assert restored.complete(max_tokens=2).finish_reason in ("length", "eos")
            restored.close()
