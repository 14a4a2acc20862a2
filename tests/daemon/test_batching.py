"""Continuous batching: one llama_decode carries every active session's next tokens, and a
long prompt goes in small chunks while other sessions are decoding.

The tests watch the real llama_decode calls through a pass-through wrapper: llama.cpp still
does all the work; the wrapper only records how many tokens each batch held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemons import GREEDY, InProcessDaemon, wait_until

import kvkeep
import kvkeepd.engine.context as context_module
from kvkeepd.engine.steps import BUSY_PREFILL_CHUNK

STORY = "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps. "


@pytest.fixture
def batch_sizes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    sizes: list[int] = []
    real = context_module.llama.llama_decode

    def recording(ctx: Any, batch: Any) -> int:
        sizes.append(int(batch.n_tokens))
        return int(real(ctx, batch))

    monkeypatch.setattr(context_module.llama, "llama_decode", recording)
    yield sizes


def _stream_in_background(session: kvkeep.Session, n: int) -> tuple[threading.Thread, threading.Event]:
    started = threading.Event()

    def run() -> None:
        for _ in session.generate(STORY, max_tokens=n, sampling=GREEDY):
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, started


def test_concurrent_sessions_share_each_decode(
    start_daemon: Callable[..., InProcessDaemon], batch_sizes: list[int]
) -> None:
    d = start_daemon(slots=4, ctx_per_session=512)
    with kvkeep.Client(d.address) as client:
        sessions = [client.create_session() for _ in range(4)]
        runs = [_stream_in_background(s, 40) for s in sessions]
        for thread, _ in runs:
            thread.join(120)
    # While all four stream, a step decodes one token of each: batches of exactly 4.
    assert batch_sizes.count(4) >= 20


def test_a_long_prompt_is_prefilled_in_small_chunks_while_others_decode(
    start_daemon: Callable[..., InProcessDaemon], batch_sizes: list[int]
) -> None:
    d = start_daemon(slots=2, ctx_per_session=1024, batch_size=512)
    with kvkeep.Client(d.address) as client:
        streaming, other = client.create_session(), client.create_session()
        thread, started = _stream_in_background(streaming, 300)
        wait_until(started.is_set, 60, "the first streamed token")
        before = len(batch_sizes)
        done = other.complete(STORY * 40, max_tokens=1, sampling=GREEDY)
        during = batch_sizes[before:]
        thread.join(120)
    assert done.usage is not None and done.usage.prompt_tokens > 600
    # Every step carried the streaming session's token plus at most one 64-token chunk.
    assert max(during) <= 1 + BUSY_PREFILL_CHUNK
    assert sum(during) >= done.usage.prompt_tokens


def test_a_lone_prompt_is_prefilled_in_full_batches(
    start_daemon: Callable[..., InProcessDaemon], batch_sizes: list[int]
) -> None:
    d = start_daemon(slots=2, ctx_per_session=1024, batch_size=512)
    with kvkeep.Client(d.address) as client:
        before = len(batch_sizes)
        client.create_session().complete(STORY * 40, max_tokens=1, sampling=GREEDY)
    assert max(batch_sizes[before:]) == 512
