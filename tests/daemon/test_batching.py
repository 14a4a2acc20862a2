"""Continuous batching: one llama_decode carries every active session's next tokens; a
prompt alone goes in whole batches, and beside other work in chunks of at most
--prefill-chunk tokens a step, fewer where --step-target says a step would take too long,
the shortest prompts first, so that a long prompt never holds a stream or a short request
for long.

The tests watch the real llama_decode calls through a pass-through wrapper: llama.cpp still
does all the work; the wrapper only records how many tokens of each sequence a batch held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemons import GREEDY, InProcessDaemon, wait_until

import kvkeep
import kvkeepd.engine.context as context_module
from kvkeepd.config.settings import Settings
from kvkeepd.engine.steps import MIN_CHUNK

CHUNK = Settings.__dataclass_fields__["prefill_chunk"].default

STORY = "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps. "


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[int, int]]]:
    """Each llama_decode's batch: tokens per sequence (slot)."""
    seen: list[dict[int, int]] = []
    real = context_module.llama.llama_decode

    def recording(ctx: Any, batch: Any) -> int:
        counts: dict[int, int] = {}
        for k in range(int(batch.n_tokens)):
            seq = int(batch.seq_id[k][0])
            counts[seq] = counts.get(seq, 0) + 1
        seen.append(counts)
        return int(real(ctx, batch))

    monkeypatch.setattr(context_module.llama, "llama_decode", recording)
    yield seen


def sizes(batches: list[dict[int, int]]) -> list[int]:
    return [sum(b.values()) for b in batches]


def _stream_in_background(session: kvkeep.Session, n: int) -> tuple[threading.Thread, threading.Event]:
    started = threading.Event()

    def run() -> None:
        for _ in session.generate(STORY, max_tokens=n, sampling=GREEDY):
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, started


def test_concurrent_sessions_share_each_decode(
    start_daemon: Callable[..., InProcessDaemon], batches: list[dict[int, int]]
) -> None:
    d = start_daemon(slots=4, ctx_per_session=512)
    with kvkeep.Client(d.address) as client:
        sessions = [client.create_session() for _ in range(4)]
        runs = [_stream_in_background(s, 40) for s in sessions]
        for thread, _ in runs:
            thread.join(120)
    # While all four stream, a step decodes one token of each: batches of exactly 4.
    assert sizes(batches).count(4) >= 20


def test_a_long_prompt_is_prefilled_in_small_chunks_while_others_decode(
    start_daemon: Callable[..., InProcessDaemon], batches: list[dict[int, int]]
) -> None:
    during, prompt_tokens = _prompt_beside_a_stream(start_daemon(slots=2, ctx_per_session=1024), batches)
    # Every step carried the streaming session's token plus at most one chunk of the prompt.
    assert max(during) <= 1 + CHUNK
    assert sum(during) >= prompt_tokens


def test_a_step_target_shrinks_the_chunks_that_would_make_long_steps(
    start_daemon: Callable[..., InProcessDaemon], batches: list[dict[int, int]]
) -> None:
    """With a 10 ms target, which no step of a prompt chunk meets on a CPU, the prompt goes
    in chunks of the fewest tokens (steps.MIN_CHUNK) once the first steps were timed; with
    none, in chunks of --prefill-chunk."""
    paced = start_daemon(slots=2, ctx_per_session=1024, step_target=0.01)
    during, prompt_tokens = _prompt_beside_a_stream(paced, batches)
    assert sum(during) >= prompt_tokens
    assert max(during) <= 1 + CHUNK
    assert during.count(1 + MIN_CHUNK) >= prompt_tokens // MIN_CHUNK - 2
    batches.clear()
    fixed = start_daemon(slots=2, ctx_per_session=1024, step_target=0)
    during, prompt_tokens = _prompt_beside_a_stream(fixed, batches)
    assert during.count(1 + CHUNK) == prompt_tokens // CHUNK


def _prompt_beside_a_stream(d: InProcessDaemon, batches: list[dict[int, int]]) -> tuple[list[int], int]:
    """The sizes of the steps while a ~700-token prompt is evaluated beside a stream, and the
    prompt's tokens."""
    with kvkeep.Client(d.address) as client:
        streaming, other = client.create_session(), client.create_session()
        thread, started = _stream_in_background(streaming, 300)
        wait_until(started.is_set, 60, "the first streamed token")
        before = len(batches)
        done = other.complete(STORY * 40, max_tokens=1, sampling=GREEDY)
        during = sizes(batches[before:])
        thread.join(120)
    assert done.usage is not None and done.usage.prompt_tokens > 600
    return during, done.usage.prompt_tokens


@pytest.mark.parametrize("chunk", [CHUNK, 64])
def test_a_lone_prompt_is_evaluated_in_full_batches(
    start_daemon: Callable[..., InProcessDaemon], batches: list[dict[int, int]], chunk: int
) -> None:
    d = start_daemon(slots=2, ctx_per_session=1024, batch_size=512, prefill_chunk=chunk)
    with kvkeep.Client(d.address) as client:
        before = len(batches)
        client.create_session().complete(STORY * 40, max_tokens=1, sampling=GREEDY)
    assert max(sizes(batches[before:])) == 512


def test_a_short_prompt_goes_ahead_of_a_long_one_in_the_same_step(
    start_daemon: Callable[..., InProcessDaemon], batches: list[dict[int, int]]
) -> None:
    """A request arriving while a long prompt is evaluated has its whole prompt in the next
    step, without any of the long prompt's, and answers while the long prompt is still being
    evaluated."""
    # A fixed chunk: a short prompt goes in whole when it fits one.
    d = start_daemon(slots=2, ctx_per_session=4096, batch_size=512, step_target=0)
    with kvkeep.Client(d.address) as client:
        long, short = client.create_session(), client.create_session()
        steps = len(batches)  # the start-up probe's batches before
        done: list[kvkeep.Completion] = []
        thread = threading.Thread(
            target=lambda: done.append(long.complete(STORY * 250, max_tokens=1, sampling=GREEDY))
        )
        thread.start()
        wait_until(lambda: len(batches) >= steps + 3, 120, "the long prompt's first steps")
        (long_slot,) = batches[steps]
        answer = short.complete(STORY * 12, max_tokens=2, sampling=GREEDY)
        assert not done, "the short request waited for the long prompt"
        thread.join(300)
    assert answer.usage is not None and CHUNK // 2 < answer.usage.prompt_tokens < CHUNK
    short_steps = [b for b in batches[steps:] if set(b) - {long_slot}]
    first = short_steps[0]
    (short_slot,) = set(first) - {long_slot}
    # Its whole prompt in one step of its own (an even share would have been half the chunk).
    assert first == {short_slot: answer.usage.prompt_tokens}
    assert all(sum(b.values()) <= CHUNK + 1 for b in batches[steps:] if len(b) > 1)
