"""Many sessions on few slots: parking, spilling, expiry, budgets and overload.

Expiry runs on an injected clock: the tests replace the session manager's clock and call
one sweep, instead of sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from daemons import InProcessDaemon, check_serving, wait_until

import kvkeep
from kvkeep import SamplingParams

STORY = "Once upon a time, in a small village by the sea, there lived"


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def clocked(d: InProcessDaemon) -> FakeClock:
    """Give the daemon's session manager a clock the test moves by hand."""
    assert d.daemon is not None and d.daemon.manager is not None
    clock = FakeClock(d.daemon.manager.clock())
    d.daemon.manager.clock = clock
    return clock


def sweep(d: InProcessDaemon) -> None:
    assert d.daemon is not None and d.daemon.manager is not None
    d.run(d.daemon.manager.expire_now())


def conversations(address: str, n: int, turns: int) -> list[tuple[int, ...]]:
    """n seeded sessions (every other one persistent), `turns` turns each, round-robin."""
    out = []
    with kvkeep.Client(address, timeout=60) as client:
        sessions = [
            client.create_session(sampling=SamplingParams(temperature=0.8, seed=i), persistent=i % 2 == 0)
            for i in range(n)
        ]
        for turn in range(turns):
            for s in sessions:
                out.append(s.complete(STORY if turn == 0 else " Then", max_tokens=6).token_ids)
        for s in sessions:
            s.close()
    return out


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def test_two_slots_give_the_same_tokens_as_sixteen(start_daemon: Callable[..., InProcessDaemon]) -> None:
    """Sessions swapped through RAM and disk see only latency, never other tokens."""
    wide = start_daemon(slots=16, ctx_per_session=512)
    expected = conversations(wide.address, 10, 3)
    wide.stop()
    # A RAM budget of about one session's cells: most parked sessions spill to disk.
    narrow = start_daemon(slots=2, ctx_per_session=512, ram_cache=600_000)
    assert conversations(narrow.address, 10, 3) == expected
    info = kvkeep.Client(narrow.address).info()
    assert info.swap_ins >= 10
    assert info.slots_in_use <= 2


def test_spilled_ephemeral_sessions_leave_nothing_on_close(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(slots=1, ctx_per_session=512, ram_cache=0)
    spill = d.settings.state_dir / "spill"
    with kvkeep.Client(d.address) as client:
        a = client.create_session(sampling=SamplingParams(temperature=0.0))
        b = client.create_session(sampling=SamplingParams(temperature=0.0))
        first = a.complete(STORY, max_tokens=4).token_ids
        b.complete(STORY, max_tokens=4)  # takes the only slot: a is parked, then spilled
        assert a.info().residency == "cold"
        assert files_under(spill)
        assert a.complete(" Then", max_tokens=4).finish_reason == "length"  # swapped back in
        b.close()
        a.close()
        assert files_under(spill) == []
        c = client.create_session(sampling=SamplingParams(temperature=0.0))
        assert c.complete(STORY, max_tokens=4).token_ids == first


def test_idle_ephemeral_sessions_expire_and_persistent_ones_stay(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(idle_ttl=60.0, sweep_interval=3600.0)
    clock = clocked(d)
    with kvkeep.Client(d.address) as client:
        ephemeral = client.create_session()
        persistent = client.create_session(persistent=True)
        fresh_later = None
        clock.now += 30
        sweep(d)
        ephemeral.info()  # not idle long enough
        clock.now += 31
        fresh_later = client.create_session()
        sweep(d)
        with pytest.raises(kvkeep.NotFoundError):
            ephemeral.info()
        assert persistent.info().persistent
        assert fresh_later.info().session_id == fresh_later.session_id


def test_persistent_ttl_deletes_idle_persistent_sessions_and_their_checkpoints(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(persistent_ttl=600.0, idle_ttl=0.0, sweep_interval=3600.0)
    clock = clocked(d)
    with kvkeep.Client(d.address) as client:
        s = client.create_session(persistent=True)
        s.complete(STORY, max_tokens=2)
        ck = s.checkpoint("kept until expiry")
        clock.now += 601
        sweep(d)
        with pytest.raises(kvkeep.NotFoundError):
            s.info()
        with pytest.raises(kvkeep.NotFoundError):
            client.fork_session(checkpoint_id=ck.checkpoint_id)


def test_without_persistent_ttl_checkpoints_are_never_expired(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(idle_ttl=1.0, sweep_interval=3600.0)
    clock = clocked(d)
    with kvkeep.Client(d.address) as client:
        s = client.create_session(persistent=True)
        s.complete(STORY, max_tokens=2)
        s.checkpoint("forever")
        clock.now += 10 * 365 * 86400
        sweep(d)
        assert [c.label for c in s.checkpoints()] == ["forever"]


def test_disk_budget_drops_unreferenced_blocks_and_refuses_what_would_not_fit(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    # One ~375-token session is ~8.6 MB of f16 KV; the budget holds one of them, not two.
    d = start_daemon(disk_budget=12_000_000, sweep_interval=3600.0, ctx_per_session=1024)
    blocks = d.settings.state_dir / "blocks"
    other = "A different story: " + STORY * 25
    with kvkeep.Client(d.address) as client:
        s = client.create_session(persistent=True, sampling=SamplingParams(temperature=0.0))
        s.complete(STORY * 25, max_tokens=1)
        ck = s.checkpoint("big")
        stored = sum(p.stat().st_size for p in files_under(blocks))
        assert stored > 4_000_000
        t = client.create_session(persistent=True, sampling=SamplingParams(temperature=0.0))
        with pytest.raises(kvkeep.BusyError, match="disk budget"):
            t.complete(other, max_tokens=1)  # its autosave would not fit: the turn is undone
        assert t.info().n_tokens == 0
        assert sum(p.stat().st_size for p in files_under(blocks)) == stored
        client.create_session().close()  # ephemeral sessions are not refused
        t.close()
        client.delete_checkpoint(ck.checkpoint_id)
        s.close()
        sweep(d)
        assert sum(p.stat().st_size for p in files_under(blocks)) <= 12_000_000
        u = client.create_session(persistent=True, sampling=SamplingParams(temperature=0.0))
        assert u.complete(other, max_tokens=1).token_ids  # room again: the old blocks were dropped


def test_a_full_queue_answers_resource_exhausted_at_once(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(slots=1, max_queue=1)
    with kvkeep.Client(d.address) as client:
        busy = client.create_session()
        waiting = client.create_session()
        refused = client.create_session()
        stream = busy.generate(STORY, max_tokens=400)
        next(stream)  # busy holds the only slot while it generates
        results: list[object] = []

        def wait_for_slot() -> None:
            try:
                results.append(waiting.complete(STORY, max_tokens=2).finish_reason)
            except kvkeep.KvkeepError as e:
                results.append(e)

        waiter = threading.Thread(target=wait_for_slot)
        waiter.start()
        wait_until(
            lambda: d.daemon and d.daemon.manager and d.daemon.manager.residency.waiting == 1, 10, "a waiter"
        )
        with pytest.raises(kvkeep.BusyError):
            refused.complete(STORY, max_tokens=2)
        stream.close()  # cancelling frees the slot for the waiter
        waiter.join(60)
        assert results == ["length"]
        check_serving(client)


def test_stress_many_clients_many_sessions_few_slots(spawn_daemon: Callable[..., object]) -> None:
    """16 clients x 50 requests over 64 sessions with 4 slots: no errors, histories intact,
    daemon memory bounded."""
    proc = spawn_daemon("--slots", "4", "--ctx-per-session", "512", "--max-queue", "64")
    address = proc.address  # type: ignore[attr-defined]
    pid = proc.pid  # type: ignore[attr-defined]
    client = kvkeep.Client(address, timeout=120)
    sessions = [client.create_session(sampling=SamplingParams(temperature=0.0)) for _ in range(64)]
    expected = {s.session_id: 0 for s in sessions}
    locks = {s.session_id: threading.Lock() for s in sessions}
    errors: list[BaseException] = []
    rss: list[int] = []

    def worker(w: int) -> None:
        try:
            for r in range(50):
                s = sessions[(w * 7 + r * 3) % 64]
                done = s.complete(" word", max_tokens=2)
                assert done.usage is not None
                with locks[s.session_id]:
                    expected[s.session_id] += done.usage.added_tokens + done.usage.generated_tokens
                if r % 10 == 0 and w == 0:
                    rss.append(_rss(pid))
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(600)
    assert errors == []
    for s in sessions:
        assert s.info().n_tokens == expected[s.session_id]
    # Bounded: 64 short sessions' cells are a few MB; the model and context about 0.5 GB.
    assert max(rss) < 2_000_000_000
    info = client.info()
    assert info.swap_ins > 0 and info.slots_in_use <= 4
    client.close()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
