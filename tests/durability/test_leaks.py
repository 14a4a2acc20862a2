"""Leaks: many create/chat/checkpoint/close cycles leave the daemon as they found it.

A daemon (subprocess) runs ``KVKEEP_LEAK_CYCLES`` cycles (default 300; run 2,000 by hand):
create a session (every other one persistent), chat once (a shared preamble of more than a
block, attached from the prefix cache, then words of its own), take a checkpoint, close.
Every tenth cycle uses a new client connection; after the 50th, a burst of concurrent
cycles. Measured from /proc and the daemon's heap metrics after a warm-up (a tenth of the
cycles, at least 150) and at the end:

- resident memory grows less than 50 MB per 2,000 cycles (the bound scales with the cycles,
  and never goes below 16 MB: the high-water mark of freed memory glibc keeps moved up to
  7 MB after the warm-up of a 2,000-cycle run);
- open file descriptors and threads are back to where they were after the warm-up;
- nothing is left: no session listed, none in the catalog, no checkpoint listed.

The burst comes early so that the threads it starts (the worker pools grow to the size they
keep, and never stop them) have their own glibc arenas filled to their high-water marks
within the warm-up: with the burst at the warm-up's end, RSS went on rising 10-18 MB over the
next 150-300 cycles, then stayed flat to cycle 750. The heap's bytes in use, printed beside,
move by a full slot's state (24 MB) from one sample to the next (a state in flight, garbage
not yet collected): a bound on them would need that much room.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from checkpoint_helpers import SPAWN_ARGS
from daemons import GREEDY, DaemonProcess, wait_until
from scraping import scrape
from servers import free_port

import kvkeep

CYCLES = int(os.environ.get("KVKEEP_LEAK_CYCLES", "300"))
# glibc keeps freed memory (see kvkeepd.heap), so RSS is a high-water mark: it settles
# within the first 150-200 cycles (measured), and only growth after that counts.
WARM_UP = max(150, CYCLES // 10)
BURST_AFTER = 50
RSS_PER_2000_CYCLES = 50 << 20
RSS_FLOOR = 16 << 20
BURST = 8


@dataclass(frozen=True)
class Usage:
    rss: int
    heap_in_use: int
    heap_free: int
    fds: int
    threads: int

    def __str__(self) -> str:
        mib = 1 << 20
        return (
            f"RSS {self.rss / mib:.1f} MiB (heap {self.heap_in_use / mib:.1f} MiB in use, "
            f"{self.heap_free / mib:.1f} MiB free), {self.fds} fds, {self.threads} threads"
        )


def usage(pid: int, metrics_port: int) -> Usage:
    """A process's resident memory, open file descriptors and threads, from /proc, and its
    C heap, from the daemon's metrics."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    samples = scrape(metrics_port)
    return Usage(
        rss_kib << 10,
        int(samples['kvkeep_heap_bytes{state="in_use"}']),
        int(samples['kvkeep_heap_bytes{state="free"}']),
        len(os.listdir(f"/proc/{pid}/fd")),
        len(os.listdir(f"/proc/{pid}/task")),
    )


def settled(pid: int, metrics_port: int, baseline: Usage) -> Usage | None:
    """The usage once descriptors and threads are back to the baseline (None before)."""
    now = usage(pid, metrics_port)
    return now if now.fds <= baseline.fds and now.threads <= baseline.threads else None


#: More than a block of tokens that every cycle's chat begins with: after the first persistent
#: session, each new session attaches that block from the store (the prefix cache) and
#: evaluates only its own tail.
PREAMBLE = " ".join(f"Item {j} is a {('red', 'blue', 'green')[j % 3]} box." for j in range(15))


def message(i: int) -> str:
    """The preamble, then words of this cycle's own (a partial block of new tokens)."""
    return f"{PREAMBLE} Now count to {i}."


def cycle(client: kvkeep.Client, i: int) -> None:
    session = client.create_session(persistent=i % 2 == 0)
    reply = session.chat(message(i), max_tokens=3, sampling=GREEDY)
    assert reply.finish_reason in ("length", "eos")
    checkpoint = session.checkpoint(f"cycle-{i}")
    assert checkpoint.n_tokens > 64
    session.close()


def burst(address: str, first: int) -> None:
    """Cycles from BURST clients at once: the daemon's worker pools grow to the size they
    keep (they start threads as requests overlap, up to a fixed number, and never stop
    them), so that the baseline has every thread a longer run may use, and its memory."""

    def run(k: int) -> None:
        with kvkeep.Client(address, timeout=60) as client:
            for j in range(4):
                cycle(client, first + 4 * k + j)

    with ThreadPoolExecutor(BURST) as pool:
        list(pool.map(run, range(BURST)))


@pytest.mark.timeout(max(600, 3 * CYCLES))
def test_create_chat_checkpoint_close_cycles_leak_nothing(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    metrics = free_port()
    proc = spawn_daemon(
        *SPAWN_ARGS, "--disk-budget", str(64 << 20), "--metrics-address", f"127.0.0.1:{metrics}"
    )
    start = usage(proc.pid, metrics)
    started = time.monotonic()
    client = kvkeep.Client(proc.address, timeout=60)
    try:
        for i in range(CYCLES):
            if i % 10 == 0:
                client.close()
                client = kvkeep.Client(proc.address, timeout=60)
            cycle(client, i)
            if i == BURST_AFTER - 1:
                burst(proc.address, CYCLES)
            if (i + 1) % 50 == 0:
                print(f"after {i + 1} cycles: {usage(proc.pid, metrics)}", flush=True)
            if i == WARM_UP - 1:
                time.sleep(1)  # let the last replies' work and connections wind down
                warm = usage(proc.pid, metrics)
        assert client.list_sessions() == []
        assert client.list_checkpoints() == []
    finally:
        client.close()
    end = wait_until(
        lambda: settled(proc.pid, metrics, warm), 30, f"fds and threads back to {warm}", interval=0.5
    )
    elapsed = time.monotonic() - started
    with contextlib.closing(sqlite3.connect(proc.state_dir / "catalog.db", timeout=30)) as db:
        assert db.execute("SELECT COUNT(*) FROM sessions").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM checkpoints").fetchone() == (0,)

    bound = max(RSS_FLOOR, RSS_PER_2000_CYCLES * (CYCLES - WARM_UP) // 2000)
    mib = 1 << 20
    print(
        f"{CYCLES} cycles in {elapsed:.0f} s; start: {start}; after {WARM_UP} cycles: {warm}; "
        f"end: {end}; RSS growth {(end.rss - warm.rss) / mib:+.1f} MiB (bound {bound / mib:.1f} MiB), "
        f"heap in use {(end.heap_in_use - warm.heap_in_use) / mib:+.1f} MiB"
    )
    assert end.rss - warm.rss < bound, f"resident memory grew from {warm} to {end}"
