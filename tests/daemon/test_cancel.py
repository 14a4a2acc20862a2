"""Leaving a stream early stops the daemon's work and leaves the session consistent.

These tests read the daemon-wide tokens_generated counter, so they get a daemon of their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from daemons import InProcessDaemon, check_serving

import kvkeep

PROMPT = "Once upon a time"
# A fixed seed: the story does not end (EOS) within the few tokens these tests read.
STORY = kvkeep.SamplingParams(temperature=0.8, seed=7)
# The engine may run ahead of what the client has read (chunks wait in gRPC's buffers) and
# finishes the step in flight when the cancellation arrives; under load that is a few tokens.
# 500 would mean it never stopped.
RUN_AHEAD = 24


@pytest.fixture(scope="module")
def own_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("cancel"), slots=2)
    yield d
    d.stop()


@pytest.fixture
def own_client(own_daemon: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(own_daemon.address, timeout=30) as c:
        yield c


def check_settled(
    client: kvkeep.Client, session: kvkeep.Session, generated_before: int, n_received: int
) -> None:
    """The cancelled request left the session consistent, and it generates again.

    The next request on a session waits until the previous one has settled, so running one
    synchronises with the daemon without sleeping.
    """
    n_prompt_tokens = 4  # "Once upon a time"
    nxt = session.complete(max_tokens=1)
    assert nxt.finish_reason in ("length", "eos")
    generated = client.info().tokens_generated - generated_before - 1
    assert n_received <= generated < n_received + RUN_AHEAD
    # History = prompt + every token the cancelled request sampled + the new one.
    assert session.info().n_tokens == n_prompt_tokens + generated + 1
    # All of it but the newest token has its KV: nothing was lost or evaluated twice.
    assert nxt.usage.reused_tokens == n_prompt_tokens + generated - 1
    assert nxt.usage.evaluated_tokens == 1
    check_serving(client)


def test_closing_the_stream_cancels_the_generation(own_client: kvkeep.Client) -> None:
    session = own_client.create_session(sampling=STORY)
    before = own_client.info().tokens_generated
    stream = session.generate(PROMPT, max_tokens=500)
    received = [next(stream) for _ in range(3)]
    stream.close()
    assert all(c.finish_reason is None for c in received)
    check_settled(own_client, session, before, sum(len(c.token_ids) for c in received))


def test_cancelling_an_async_task_cancels_the_generation(
    own_daemon: InProcessDaemon, own_client: kvkeep.Client
) -> None:
    async def scenario() -> tuple[str, int, int]:
        async with kvkeep.AsyncClient(own_daemon.address, timeout=30) as aclient:
            session = await aclient.create_session(sampling=STORY)
            before = (await aclient.info()).tokens_generated
            received: list[kvkeep.Chunk] = []
            three = asyncio.Event()

            async def consume() -> None:
                async for chunk in session.generate(PROMPT, max_tokens=500):
                    received.append(chunk)
                    if len(received) == 3:
                        three.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(three.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return session.session_id, before, sum(len(c.token_ids) for c in received)

    session_id, before, n_received = asyncio.run(scenario())
    check_settled(own_client, own_client.session(session_id), before, n_received)


def test_client_that_disconnects_mid_stream(own_daemon: InProcessDaemon, own_client: kvkeep.Client) -> None:
    leaving = kvkeep.Client(own_daemon.address)
    session_id = leaving.create_session(sampling=STORY).session_id
    before = own_client.info().tokens_generated
    stream = leaving.session(session_id).generate(PROMPT, max_tokens=500)
    received = [next(stream) for _ in range(2)]
    leaving.close()  # the channel goes away with the call in flight
    with pytest.raises(kvkeep.KvkeepError):
        next(stream)
    check_settled(own_client, own_client.session(session_id), before, sum(len(c.token_ids) for c in received))
