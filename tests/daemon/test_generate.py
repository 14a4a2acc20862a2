"""Raw generation on the real model: info, streaming, finish reasons, continuation, determinism."""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator

import pytest
from daemons import GREEDY, InProcessDaemon, model_path

import kvkeep

PROMPT = "The capital of France is"
SEEDED = kvkeep.SamplingParams(temperature=0.8, seed=1234)


@pytest.fixture
def session(client: kvkeep.Client) -> Iterator[kvkeep.Session]:
    s = client.create_session()
    yield s
    s.close()


def test_info_reports_model_mode_slots_and_context(client: kvkeep.Client) -> None:
    info = client.info()
    digest = hashlib.blake2b(model_path().read_bytes(), digest_size=32).hexdigest()
    assert info.model_fingerprint == digest
    assert info.model_path == str(model_path())
    assert info.mode == "exact"
    assert info.kv_type == "f16"
    assert info.slots == 4
    assert info.ctx_per_session == 1024
    assert info.max_prompt_tokens == 1024
    assert info.n_vocab == 49152
    assert info.n_ctx_train >= 1024
    assert info.has_chat_template
    assert info.version
    assert 0 <= info.slots_in_use <= info.slots


def test_generate_streams_chunks_and_the_last_has_finish_reason_and_usage(
    session: kvkeep.Session,
) -> None:
    chunks = list(session.generate(PROMPT, max_tokens=8, sampling=GREEDY))
    assert len(chunks) >= 2
    *body, last = chunks
    for chunk in body:
        assert chunk.finish_reason is None
        assert chunk.usage is None
    assert all(chunk.token_ids for chunk in body)
    assert last.finish_reason == "length"
    assert last.usage is not None
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == 8
    assert all(0 <= t < 49152 for t in token_ids)
    assert "".join(c.text for c in chunks).strip()
    assert last.usage.generated_tokens == 8
    assert last.usage.prompt_tokens == session.info().n_tokens - 8
    assert last.usage.reused_tokens == 0
    # A fresh session: the whole prompt is new, and all of it ran through the model.
    assert last.usage.added_tokens == last.usage.evaluated_tokens == last.usage.prompt_tokens


def test_complete_joins_the_stream(client: kvkeep.Client) -> None:
    a = client.create_session(sampling=GREEDY)
    b = client.create_session(sampling=GREEDY)
    chunks = list(a.generate(PROMPT, max_tokens=8))
    completion = b.complete(PROMPT, max_tokens=8)
    assert completion.token_ids == tuple(t for c in chunks for t in c.token_ids)
    assert completion.text == "".join(c.text for c in chunks)
    assert completion.finish_reason == "length"
    assert completion.usage == chunks[-1].usage
    a.close()
    b.close()


def test_prompt_as_token_ids(client: kvkeep.Client) -> None:
    reference = client.create_session(sampling=GREEDY).complete(PROMPT, max_tokens=16).token_ids

    # The same history built from text and from ids continues the same way.
    session = client.create_session(sampling=GREEDY)
    assert session.complete(PROMPT, max_tokens=8).token_ids == reference[:8]
    n_before = session.info().n_tokens
    more = session.complete(list(reference[8:12]), max_tokens=4)
    assert more.usage.added_tokens == 4
    assert more.usage.prompt_tokens == n_before + 4
    assert session.info().n_tokens == n_before + 4 + 4
    assert more.token_ids == reference[12:16]

    # Ids alone on a fresh session.
    fresh = client.create_session(sampling=GREEDY)
    completion = fresh.complete(list(reference[:8]), max_tokens=4)
    assert completion.usage.prompt_tokens == 8
    assert len(completion.token_ids) == 4
    assert fresh.info().n_tokens == 12


def test_logprobs_give_n_alternatives_per_token(session: kvkeep.Session) -> None:
    chunks = list(session.generate(PROMPT, max_tokens=6, logprobs=3, sampling=GREEDY))
    token_ids = [t for c in chunks for t in c.token_ids]
    logprobs = [g for c in chunks for g in c.logprobs]
    for chunk in chunks:
        assert len(chunk.logprobs) == len(chunk.token_ids)
    assert len(logprobs) == len(token_ids) == 6
    for token, generated in zip(token_ids, logprobs, strict=True):
        assert generated.sampled.token_id == token
        assert generated.sampled.logprob <= 0.0
        assert math.isfinite(generated.sampled.logprob)
        assert len(generated.top) == 3
        top = [t.logprob for t in generated.top]
        assert top == sorted(top, reverse=True)
        assert all(lp <= 0.0 for lp in top)
        assert len({t.token_id for t in generated.top}) == 3
        # Greedy: the sampled token is the most likely one.
        assert generated.top[0].token_id == token
        assert generated.top[0].logprob == pytest.approx(generated.sampled.logprob)
        assert sum(math.exp(lp) for lp in top) <= 1.0 + 1e-4


def test_max_tokens_ends_with_length(session: kvkeep.Session) -> None:
    completion = session.complete(PROMPT, max_tokens=5, sampling=GREEDY)
    assert completion.finish_reason == "length"
    assert len(completion.token_ids) == completion.usage.generated_tokens == 5


def test_stop_string_ends_with_stop_and_is_not_returned(client: kvkeep.Client) -> None:
    full = client.create_session(sampling=GREEDY).complete(PROMPT, max_tokens=16)
    stop = full.text.split()[1]  # the second word of what the model says anyway
    expected = full.text[: full.text.index(stop)]

    session = client.create_session(sampling=GREEDY)
    chunks = list(session.generate(PROMPT, max_tokens=16, stop=[stop]))
    text = "".join(c.text for c in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].finish_reason == "stop"
    assert usage is not None
    assert stop not in text
    assert text == expected
    # The stop string's tokens were generated (and stay in the history), but not returned.
    assert usage.generated_tokens < 16
    assert session.info().n_tokens == usage.prompt_tokens + usage.generated_tokens


def test_session_stop_strings_apply_to_every_request(client: kvkeep.Client) -> None:
    full = client.create_session(sampling=GREEDY).complete(PROMPT, max_tokens=16)
    stop = full.text.split()[1]
    session = client.create_session(sampling=GREEDY, stop=[stop])
    assert session.info().stop == (stop,)
    completion = session.complete(PROMPT, max_tokens=16)
    assert completion.finish_reason == "stop"
    assert completion.text == full.text[: full.text.index(stop)]


def test_end_of_generation_token_ends_with_eos(session: kvkeep.Session) -> None:
    # A short question through the chat template: the instruct model answers and ends its turn.
    completion = session.chat("What is 2+2?", max_tokens=96, sampling=GREEDY)
    assert completion.finish_reason == "eos"
    assert len(completion.token_ids) < 96
    assert "<|im_end|>" not in completion.text
    assert completion.text.strip()


def test_full_context_ends_with_context_full(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    small = start_daemon(slots=1, ctx_per_session=256)
    with kvkeep.Client(small.address, timeout=30) as client:
        probe = client.create_session(sampling=GREEDY)
        token = probe.complete("The", max_tokens=1).token_ids[0]
        session = client.create_session(sampling=GREEDY)
        # No max_tokens: generate until the context is full.
        completion = session.complete([token] * 240)
        assert completion.finish_reason == "context_full"
        assert completion.usage.generated_tokens == 256 - 240
        assert session.info().n_tokens == 256
        with pytest.raises(kvkeep.ContextFullError):
            session.complete("more", max_tokens=1)


def test_empty_prompt_continues_and_reuses_held_tokens(session: kvkeep.Session) -> None:
    first = session.complete(PROMPT, max_tokens=8, sampling=GREEDY)
    held = session.info().n_tokens
    assert held == first.usage.prompt_tokens + 8

    second = session.complete(max_tokens=8, sampling=GREEDY)
    assert second.finish_reason == "length"
    assert second.usage.added_tokens == 0
    assert second.usage.prompt_tokens == held
    assert second.usage.generated_tokens == 8
    # Every held token but the last sampled one (never decoded yet) has its KV computed.
    assert second.usage.reused_tokens == held - 1
    # Only that last token of the prompt ran through the model.
    assert second.usage.evaluated_tokens == 1
    assert session.info().n_tokens == held + 8

    # A text prompt on top: only the pending token and the new prompt are evaluated.
    third = session.complete(" And", max_tokens=4, sampling=GREEDY)
    assert third.usage.reused_tokens == held + 8 - 1
    assert third.usage.evaluated_tokens == third.usage.added_tokens + 1
    assert third.usage.prompt_tokens == held + 8 + third.usage.added_tokens
    assert session.info().n_tokens == held + 8 + third.usage.added_tokens + 4


def test_continuation_equals_one_long_generation(client: kvkeep.Client) -> None:
    whole = client.create_session(sampling=GREEDY).complete(PROMPT, max_tokens=16)
    session = client.create_session(sampling=GREEDY)
    halves = session.complete(PROMPT, max_tokens=8).token_ids
    halves += session.complete(max_tokens=8).token_ids
    assert halves == whole.token_ids


def test_same_seed_gives_same_tokens_on_fresh_sessions(client: kvkeep.Client) -> None:
    runs = [
        client.create_session(sampling=SEEDED).complete(PROMPT, max_tokens=24).token_ids for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 24
    # The seed is the session's: set per request it gives the same draws.
    per_request = client.create_session().complete(PROMPT, max_tokens=24, sampling=SEEDED)
    assert per_request.token_ids == runs[0]


def test_same_seed_gives_same_tokens_while_other_sessions_generate(
    client: kvkeep.Client,
) -> None:
    reference = client.create_session(sampling=SEEDED).complete(PROMPT, max_tokens=24).token_ids

    started = [threading.Event() for _ in range(3)]
    errors: list[BaseException] = []
    finishes: list[str | None] = []

    def background(n: int) -> None:
        try:
            session = client.create_session(sampling=kvkeep.SamplingParams(seed=n))
            prompt = ["Once upon a time", "def fibonacci(n):", "My favourite colour"][n]
            last = None
            for chunk in session.generate(prompt, max_tokens=64):
                started[n].set()
                last = chunk
            finishes.append(last.finish_reason if last else None)
        except BaseException as e:
            errors.append(e)
        finally:
            started[n].set()

    threads = [threading.Thread(target=background, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(60)
    concurrent = client.create_session(sampling=SEEDED).complete(PROMPT, max_tokens=24)
    for t in threads:
        t.join(120)
    assert not errors
    assert len(finishes) == 3
    assert set(finishes) <= {"length", "eos"}
    assert concurrent.token_ids == reference


def test_one_call_equals_two_halves_with_a_seed(client: kvkeep.Client) -> None:
    whole = client.create_session(sampling=SEEDED).complete(PROMPT, max_tokens=32)
    session = client.create_session(sampling=SEEDED)
    first = session.complete(PROMPT, max_tokens=16)
    second = session.complete(max_tokens=16)
    assert first.finish_reason == second.finish_reason == "length"
    assert first.token_ids + second.token_ids == whole.token_ids
    assert first.text + second.text == whole.text
