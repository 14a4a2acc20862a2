"""Where a session's state lives, and moves that fail: the slot is freed, the session falls
back to its history, the daemon goes on.

- A daemon restarted with another --kv-type: the old sessions' states no longer fit; their
  histories are evaluated again (no FAILED_PRECONDITION, no hang, even with one slot).
- A damaged block under a stored session: that request gets DATA_LOSS, other sessions go on,
  and the session's next request evaluates its history again, exactly.
- The invariant check itself sees a slot that holds cells nobody owns.
- A state's epoch (what rollbacks in place go by) changes exactly when cells are taken away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_helpers import (
    GREEDY,
    SAMPLED,
    SPAWN_ARGS,
    block_files,
    catalog_manifest,
    checkpoint_tokens,
    flip_bit,
    gen,
    manifest_blocks,
)
from daemons import DaemonProcess, InProcessDaemon

import kvkeep
from kvkeepd.engine.context import BatchItem
from kvkeepd.engine.engine import Engine
from kvkeepd.engine.job import SeqState


def test_a_restart_with_another_kv_type_evaluates_histories_again(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    first = spawn_daemon(*SPAWN_ARGS, "--slots", "1")
    with kvkeep.Client(first.address, timeout=60) as client:
        s = client.create_session("You are terse.", persistent=True, sampling=GREEDY)
        reply = s.chat("Name a colour.", max_tokens=8)
        n_tokens = s.info().n_tokens
    first.terminate()
    second = spawn_daemon(*SPAWN_ARGS, "--slots", "1", "--kv-type", "q8_0", state_dir=first.state_dir)
    with kvkeep.Client(second.address, timeout=60) as client:
        assert client.info().mode == "compact"
        again = client.session(s.session_id)
        assert again.info().n_tokens == n_tokens
        c = again.complete(" And", max_tokens=4)  # its state is evaluated again, not refused
        assert c.usage.evaluated_tokens >= n_tokens
        started = time.monotonic()
        assert client.info().sessions == 1
        assert time.monotonic() - started < 2
        other = client.create_session(sampling=GREEDY)
        assert other.complete("Hello", max_tokens=2).finish_reason in ("length", "eos")
        assert reply.text


def test_a_damaged_block_fails_one_request_and_the_session_recovers(
    spawn_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    # Every turn saves its head: the damaged block is one of the head's.
    d = spawn_daemon(*SPAWN_ARGS, "--slots", "2", "--head-interval", "1")
    with kvkeep.Client(d.address, timeout=60) as client:
        bad = client.create_session(sampling=SAMPLED, persistent=True)
        gen(bad, "The harbour master counted the boats at dawn and", 8)
        good = client.create_session(sampling=SAMPLED, persistent=True)
        gen(good, "A baker in the old town rose early", 8)
        history = client.session(bad.session_id).info().n_tokens
        head = bad.info().head_checkpoint_id
        assert head
    d.terminate()
    path = block_files(d.state_dir)[manifest_blocks(catalog_manifest(d.state_dir, head))[0]]
    flip_bit(path, path.stat().st_size // 2)  # the sessions share no block: other prompts
    d.start()
    with kvkeep.Client(d.address, timeout=60) as client:
        bad = client.session(bad.session_id)
        with pytest.raises(kvkeep.CorruptCheckpointError):
            bad.complete("", max_tokens=4)
        assert gen(client.session(good.session_id), "", 4)  # other sessions go on
        # The history survived: the next request evaluates it again, as a fresh session would.
        assert bad.info().n_tokens == history
        tokens = checkpoint_tokens(client, bad.checkpoint("audit").checkpoint_id, tmp_path)
        assert len(tokens) == history
        first = bad.complete("", max_tokens=6, logprobs=1, sampling=GREEDY)
        assert first.usage.evaluated_tokens >= history - 1
        second = client.create_session().complete(tokens, max_tokens=6, logprobs=1, sampling=GREEDY)
        assert [t.sampled for t in first.logprobs] == [t.sampled for t in second.logprobs]


def test_the_invariant_check_sees_cells_nobody_owns(start_daemon: Callable[..., InProcessDaemon]) -> None:
    d = start_daemon(slots=2)
    assert d.daemon is not None and d.daemon.manager is not None
    manager = d.daemon.manager
    with kvkeep.Client(d.address, timeout=30) as client:
        s = client.create_session(sampling=GREEDY)
        s.complete("Hello there", max_tokens=2)
    assert d.check_invariant() == []

    free = manager.residency.slot_owners().index(None)
    d.run(_on_engine(manager.engine, lambda e: e.ctx.decode([BatchItem(free, 1, 0, False)])))
    problems = d.check_invariant()
    assert any(f"slot {free} should be empty" in p for p in problems), problems
    d.run(_on_engine(manager.engine, lambda e: e.ctx.clear(free)))
    assert d.check_invariant() == []


async def _on_engine(engine: Engine, fn: Callable[[Engine], object]) -> object:
    return await asyncio.wrap_future(engine.call(fn))


def test_a_state_epoch_changes_exactly_when_cells_are_taken_away() -> None:
    a, b = SeqState(), SeqState()
    assert a.epoch != b.epoch
    first = a.epoch
    a.n_kv = 10
    a.n_kv = 12
    assert a.epoch == first  # cells only added
    a.n_kv = 11
    assert a.epoch not in (first, b.epoch)
    cut = a.epoch
    a.n_kv = 0
    assert a.epoch != cut
