"""Budgets hold at every moment, whatever the entry point: --ram-cache bounds parked states and
ephemeral sessions' checkpoints; --disk-budget bounds the blocks, the spill area and the
catalog. Beyond them a request gets RESOURCE_EXHAUSTED; nothing grows past them.

A 2,000-token state of the default model is 46 MB, so a 100 MB RAM cache holds two: forks
and restores beyond that spill the least recently used ones to disk.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from checkpoint_helpers import GREEDY, gen, ids, long_text
from daemons import InProcessDaemon

import kvkeep

RAM = 100_000_000
DISK = 200_000_000
FORKS = 100
RESTORES = 100


def disk_bytes(state_dir: Path) -> int:
    """What the daemon keeps on disk: block files, the spill area, the catalog."""
    total = 0
    for sub in ("blocks", "spill"):
        total += sum(p.stat().st_size for p in (state_dir / sub).rglob("*") if p.is_file())
    total += sum(p.stat().st_size for p in state_dir.glob("catalog.db*"))
    return total


class Watch:
    """Samples what a daemon reports (its published counters) and its state dir on disk, in
    a thread, every few milliseconds while a test runs; keeps the peaks."""

    def __init__(self, d: InProcessDaemon) -> None:
        assert d.daemon is not None and d.daemon.manager is not None
        self.manager = d.daemon.manager
        self.state_dir = d.settings.state_dir
        self.peak_ram = self.peak_reported_disk = self.peak_disk = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.sample()

    def sample(self) -> None:
        counters = self.manager.counters
        self.peak_ram = max(self.peak_ram, counters.parked_bytes)
        self.peak_reported_disk = max(self.peak_reported_disk, counters.store_bytes)
        with contextlib.suppress(FileNotFoundError):  # a file removed while it was listed
            self.peak_disk = max(self.peak_disk, disk_bytes(self.state_dir))
        self.samples += 1

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@pytest.fixture
def big(start_daemon: Callable[..., InProcessDaemon]) -> Iterator[tuple[InProcessDaemon, kvkeep.Client]]:
    d = start_daemon(ram_cache=RAM, disk_budget=DISK, ctx_per_session=2048, slots=2)
    with kvkeep.Client(d.address, timeout=300) as client:
        yield d, client


@pytest.mark.timeout(900)
def test_forks_and_restores_keep_ram_and_disk_within_their_budgets(
    big: tuple[InProcessDaemon, kvkeep.Client],
) -> None:
    d, client = big
    source = client.create_session(persistent=True, sampling=GREEDY)
    source.complete(long_text(108), max_tokens=1)
    assert source.info().n_tokens > 1900
    checkpoint = source.checkpoint("big")
    expected = ids(gen(source.fork(), n=6))
    with Watch(d) as watch:
        forks = [client.fork_session(checkpoint_id=checkpoint.checkpoint_id) for _ in range(FORKS)]
        for i in range(RESTORES):
            forks[i % len(forks)].restore(checkpoint.checkpoint_id)
    assert watch.samples > 100
    assert watch.peak_ram <= RAM, f"RAM held {watch.peak_ram} bytes, over the budget of {RAM}"
    assert watch.peak_reported_disk <= DISK
    assert watch.peak_disk <= DISK, f"the state dir held {watch.peak_disk} bytes, over {DISK}"
    info = client.info()
    assert info.sessions_warm <= 2 < info.sessions_cold
    # The first fork was spilled long ago, the last restored ones are parked: all continue
    # exactly as the source would.
    for fork in (forks[0], forks[len(forks) // 2], forks[-1]):
        assert ids(gen(fork, n=6)) == expected


def test_an_ephemeral_checkpoint_beyond_the_ram_cache_is_refused(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(ram_cache=8_000_000)
    with kvkeep.Client(d.address, timeout=300) as client:
        session = client.create_session(sampling=GREEDY)
        session.complete(long_text(27), max_tokens=1)  # ~500 tokens: 11.5 MB of state
        with pytest.raises(kvkeep.BusyError, match="RAM cache"):
            session.checkpoint("too big")
        assert client.list_checkpoints(session.session_id) == []
        small = client.create_session(sampling=GREEDY)
        small.complete("A short one.", max_tokens=2)
        assert small.checkpoint("fits").n_tokens > 0
        assert len(gen(session, n=3)) == 3  # the big one goes on


def test_a_persistent_checkpoint_beyond_the_disk_budget_is_refused(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    budget = 16_000_000
    d = start_daemon(disk_budget=budget)
    with kvkeep.Client(d.address, timeout=300) as client:
        session = client.create_session(persistent=True, sampling=GREEDY)
        # The autosave of ~500 tokens (11.5 MB) fits, and so does a checkpoint sharing its
        # blocks; the blocks of a second, different history do not.
        session.complete(long_text(27), max_tokens=1)
        first = session.checkpoint("shares the head's blocks")
        assert first.bytes_written < 1_000_000
        other = client.create_session(persistent=True, sampling=GREEDY)
        with pytest.raises(kvkeep.BusyError, match="disk budget"):
            other.complete(long_text(27, topic="orchard"), max_tokens=1)
        assert disk_bytes(d.settings.state_dir) <= budget
        # The refused turn was undone: the history is as before, so sending it again is safe.
        assert other.info().n_tokens == 0
        assert len(gen(session, n=3)) == 3
