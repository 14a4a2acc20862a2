"""Bad requests get the right error, and the daemon keeps serving after each."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
from daemons import InProcessDaemon, check_serving

import kvstash


@pytest.fixture
def session(client: kvstash.Client) -> Iterator[kvstash.Session]:
    s = client.create_session()
    yield s
    s.close()


@pytest.fixture
def token(client: kvstash.Client) -> int:
    """Some valid token id."""
    probe = client.create_session()
    try:
        return probe.complete("The", max_tokens=1).token_ids[0]
    finally:
        probe.close()


def test_empty_prompt_on_a_fresh_session(client: kvstash.Client, session: kvstash.Session) -> None:
    with pytest.raises(kvstash.InvalidRequestError, match="empty"):
        session.complete("", max_tokens=4)
    assert session.info().n_tokens == 0
    check_serving(client)


def test_empty_chat_message(client: kvstash.Client, session: kvstash.Session) -> None:
    with pytest.raises(kvstash.InvalidRequestError):
        session.chat("", max_tokens=4)
    check_serving(client)


def test_prompt_longer_than_the_context(client: kvstash.Client, session: kvstash.Session, token: int) -> None:
    # More tokens than the whole context (1024) is a bad argument, not a full context.
    with pytest.raises(kvstash.InvalidRequestError) as e:
        session.complete([token] * 1100, max_tokens=1)
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(kvstash.InvalidRequestError):
        session.complete(" hello" * 1100, max_tokens=1)
    assert session.info().n_tokens == 0
    check_serving(client)
    assert session.complete("Hello", max_tokens=1).usage.generated_tokens == 1


def test_prompt_plus_max_tokens_beyond_the_context(
    client: kvstash.Client, session: kvstash.Session, token: int
) -> None:
    with pytest.raises(kvstash.ContextFullError) as e:
        session.complete([token] * 1000, max_tokens=100)
    assert e.value.code == "OUT_OF_RANGE"
    # A prompt that fills the context exactly leaves no room for one token either.
    with pytest.raises(kvstash.ContextFullError):
        session.complete([token] * 1024)
    assert session.info().n_tokens == 0
    check_serving(client)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_not_positive(client: kvstash.Client, session: kvstash.Session, max_tokens: int) -> None:
    with pytest.raises(kvstash.InvalidRequestError, match="max_tokens"):
        session.complete("Hello", max_tokens=max_tokens)
    assert session.info().n_tokens == 0
    check_serving(client)


@pytest.mark.parametrize(
    "sampling",
    [
        kvstash.SamplingParams(temperature=-0.5),
        kvstash.SamplingParams(temperature=math.nan),
        kvstash.SamplingParams(temperature=math.inf),
        kvstash.SamplingParams(top_p=0.0),
        kvstash.SamplingParams(top_k=-1),
        kvstash.SamplingParams(min_p=1.5),
        kvstash.SamplingParams(repeat_penalty=0.0),
        kvstash.SamplingParams(penalty_last_n=-2),
    ],
    ids=[
        "negative-temperature",
        "nan-temperature",
        "inf-temperature",
        "top_p-0",
        "negative-top_k",
        "min_p-above-1",
        "repeat_penalty-0",
        "penalty_last_n-below-minus-1",
    ],
)
def test_bad_sampling_parameters(
    client: kvstash.Client, session: kvstash.Session, sampling: kvstash.SamplingParams
) -> None:
    with pytest.raises(kvstash.InvalidRequestError):
        session.complete("Hello", max_tokens=2, sampling=sampling)
    with pytest.raises(kvstash.InvalidRequestError):
        session.chat("Hello", max_tokens=2, sampling=sampling)
    with pytest.raises(kvstash.InvalidRequestError):
        client.create_session(sampling=sampling)
    assert session.info().n_tokens == 0
    check_serving(client)


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_logprobs_out_of_range(client: kvstash.Client, session: kvstash.Session, logprobs: int) -> None:
    with pytest.raises(kvstash.InvalidRequestError, match="logprobs"):
        session.complete("Hello", max_tokens=2, logprobs=logprobs)
    check_serving(client)


def test_token_ids_outside_the_vocabulary(client: kvstash.Client, session: kvstash.Session) -> None:
    for bad in (-1, 49152, 2**31 - 1):
        with pytest.raises(kvstash.InvalidRequestError, match="vocabulary"):
            session.complete([1, bad], max_tokens=1)
    check_serving(client)


def test_bad_stop_strings(client: kvstash.Client, session: kvstash.Session) -> None:
    with pytest.raises(kvstash.InvalidRequestError):
        session.complete("Hello", max_tokens=2, stop=[""])
    with pytest.raises(kvstash.InvalidRequestError):
        session.complete("Hello", max_tokens=2, stop=["x" * 1000])
    with pytest.raises(kvstash.InvalidRequestError):
        session.complete("Hello", max_tokens=2, stop=[str(n) for n in range(100)])
    check_serving(client)


def test_unknown_session_id(client: kvstash.Client) -> None:
    unknown = "s_" + "0" * 24
    with pytest.raises(kvstash.NotFoundError):
        client.session(unknown)
    ghost = kvstash.Session(client, unknown)
    with pytest.raises(kvstash.NotFoundError):
        ghost.complete("Hello", max_tokens=2)
    with pytest.raises(kvstash.NotFoundError):
        ghost.chat("Hello", max_tokens=2)
    with pytest.raises(kvstash.NotFoundError):
        ghost.close()
    check_serving(client)


@pytest.mark.parametrize("session_id", ["../../etc", "", "s_XYZ", "s_" + "0" * 200, "s_\x00"])
def test_malformed_session_id(client: kvstash.Client, session_id: str) -> None:
    with pytest.raises(kvstash.InvalidRequestError, match="malformed"):
        client.session(session_id)
    with pytest.raises(kvstash.InvalidRequestError):
        kvstash.Session(client, session_id).complete("Hello", max_tokens=2)
    check_serving(client)


def test_closed_session(client: kvstash.Client) -> None:
    session = client.create_session()
    session.complete("Hello", max_tokens=2)
    session.close()
    with pytest.raises(kvstash.NotFoundError):
        session.info()
    with pytest.raises(kvstash.NotFoundError):
        session.complete("Hello", max_tokens=2)
    with pytest.raises(kvstash.NotFoundError):
        session.close()
    assert session.session_id not in {s.session_id for s in client.list_sessions()}
    check_serving(client)


def test_message_over_the_size_limit(start_daemon: Callable[..., InProcessDaemon]) -> None:
    small = start_daemon(slots=1, max_message_bytes=64 * 1024)
    with kvstash.Client(small.address, timeout=30) as client:
        session = client.create_session()
        with pytest.raises(kvstash.BusyError) as e:
            session.complete("a" * (100 * 1024), max_tokens=1)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        with pytest.raises(kvstash.BusyError):
            client.create_session("a" * (100 * 1024))
        check_serving(client)
        assert session.complete("Hello", max_tokens=2).usage.generated_tokens >= 1
