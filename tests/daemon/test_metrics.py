"""The Prometheus endpoint reports the same counters as GetInfo."""

from __future__ import annotations

from collections.abc import Callable

from daemons import GREEDY, InProcessDaemon
from scraping import scrape

import kvkeep


def test_metrics_follow_sessions_and_tokens(start_daemon: Callable[..., InProcessDaemon]) -> None:
    d = start_daemon(slots=2, metrics_address="127.0.0.1:0")
    assert d.daemon is not None
    port = d.daemon.metrics_port
    before = scrape(port)
    assert before["kvkeep_slots"] == 2
    assert before['kvkeep_sessions{tier="hot"}'] == 0
    with kvkeep.Client(d.address) as client:
        s = client.create_session()
        done = s.complete("Count to three:", max_tokens=4, sampling=GREEDY)
        after = scrape(port)
        info = client.info()
    assert after['kvkeep_sessions{tier="hot"}'] == 1
    assert after["kvkeep_slots_in_use"] == 1
    assert after['kvkeep_tokens_total{kind="generated"}'] == info.tokens_generated >= len(done.token_ids)
    assert after['kvkeep_tokens_total{kind="evaluated"}'] == info.tokens_evaluated


def test_metrics_report_process_and_heap_memory(start_daemon: Callable[..., InProcessDaemon]) -> None:
    d = start_daemon(slots=1, metrics_address="127.0.0.1:0")
    assert d.daemon is not None
    samples = scrape(d.daemon.metrics_port)
    # The model alone is tens of MB resident; the heap holds at least the KV buffers' owners.
    assert samples["process_resident_memory_bytes"] > 50 << 20
    assert samples["process_open_fds"] > 0
    assert samples['kvkeep_heap_bytes{state="in_use"}'] > 1 << 20
    assert samples['kvkeep_heap_bytes{state="free"}'] >= 0
