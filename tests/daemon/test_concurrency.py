"""Many clients at once: every request finishes, with consistent token counts."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from daemons import InProcessDaemon

import kvkeep

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def add(a, b):",
    "Water boils at",
    "My favourite book is",
    "In 1969, astronauts",
    "The quick brown fox",
    "A recipe for pancakes:",
]


@pytest.mark.parametrize("slots", [4, 8])
def test_eight_clients_on_eight_sessions(start_daemon: Callable[..., InProcessDaemon], slots: int) -> None:
    d = start_daemon(slots=slots, ctx_per_session=256)
    max_tokens = 12
    results: dict[int, tuple[list[kvkeep.Chunk], int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS), timeout=60)

    def worker(n: int) -> None:
        try:
            with kvkeep.Client(d.address, timeout=120) as client:
                session = client.create_session(sampling=kvkeep.SamplingParams(seed=n))
                barrier.wait()  # all eight start generating together
                chunks = list(session.generate(PROMPTS[n], max_tokens=max_tokens))
                results[n] = (chunks, session.info().n_tokens)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert sorted(results) == list(range(len(PROMPTS)))
    generated = 0
    for chunks, n_tokens in results.values():
        *body, last = chunks
        assert all(c.finish_reason is None and c.usage is None for c in body)
        assert last.finish_reason in ("length", "eos")
        usage = last.usage
        assert usage is not None
        n_ids = sum(len(c.token_ids) for c in chunks)
        assert n_ids == usage.generated_tokens
        if last.finish_reason == "length":
            assert usage.generated_tokens == max_tokens
        else:
            assert 1 <= usage.generated_tokens <= max_tokens
        assert usage.prompt_tokens >= 1
        assert n_tokens == usage.prompt_tokens + usage.generated_tokens
        assert usage.evaluated_tokens == usage.prompt_tokens
        generated += usage.generated_tokens

    with kvkeep.Client(d.address, timeout=30) as client:
        info = client.info()
        assert info.sessions == len(PROMPTS)
        assert info.slots_in_use <= slots
        assert info.tokens_generated == generated
