"""A chain of stored responses holds RAM within --ram-cache.

Each step of a chain (`previous_response_id`) stores the conversation's whole state; the
daemon keeps the newest two in RAM, within --ram-cache, and nothing else of the chain may
stay behind: not a state the cache gave up, not what an earlier step's generation loaded.
The chain runs past its context (`truncation: auto`), so that each step cuts the history,
loads its prefix from the stored blocks and evaluates the rest again, the path that kept a
state more per step. Python's cycle collector is off while it runs: RAM must be bounded by
references dropped when they are done with, not by when the collector happens to run
(its oldest generation ran every hundred steps or so, and held up to 330 MB then with a
64 MiB cache). `scripts/bench chain` runs 1,000 steps against a daemon process.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import openai
from daemons import InProcessDaemon

from kvkeepd.heap import heap_usage

RAM_CACHE = 16 << 20
STEPS = 100
MIB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_chain_of_stored_responses_holds_ram_within_the_ram_cache(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    # A context of 256 tokens: the chain outgrows it after some 20 steps of ~13 tokens.
    d = start_daemon(http_address="127.0.0.1:0", ram_cache=RAM_CACHE, ctx_per_session=256, slots=1)
    assert d.daemon is not None
    residency = d.daemon.manager.residency
    url = f"http://127.0.0.1:{d.daemon.http_port}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)

    async def held() -> int:
        # The daemon's own count: parked states, ephemeral checkpoints, kept whole states.
        return residency.ram_bytes() + residency.wholes.nbytes

    def step(previous: str | None) -> openai.types.responses.Response:
        kw = {"previous_response_id": previous} if previous else {}
        return client.responses.create(
            model="any", input="Hi", max_output_tokens=1, temperature=0, truncation="auto", **kw
        )

    previous = step(None).id
    heap, resident = heap_usage(), rss()
    assert heap is not None
    gc.collect()
    gc.disable()
    try:
        for n in range(STEPS):
            r = step(previous)
            previous = r.id
            now = d.run(held())
            grown = heap_usage()
            assert grown is not None
            assert now <= RAM_CACHE, f"step {n}: the daemon holds {now} bytes"
            heap_grew, rss_grew = grown.in_use - heap.in_use, rss() - resident
            assert heap_grew <= RAM_CACHE + 32 * MIB, f"step {n}: the heap grew {heap_grew / MIB:.0f} MiB"
            assert rss_grew <= RAM_CACHE + 64 * MIB, f"step {n}: RSS grew {rss_grew / MIB:.0f} MiB"
    finally:
        gc.enable()
    # Some 1,300 tokens were said: the conversation held is what fits.
    assert r.usage.input_tokens < 256
