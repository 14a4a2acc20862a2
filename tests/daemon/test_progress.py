"""The prompt's evaluation reported as it goes, when a request asks for it.

- The SDK (blocking and asyncio): ``on_progress`` gets a PromptProgress as the evaluation
  begins (its processed tokens the cached ones) and after each batch of ``--batch-size``
  tokens, all before the first chunk; processed only grows and ends at the total, the
  context the reply follows. A second turn counts the history it reuses as cached.
- gRPC: ``return_progress`` gives chunks that carry ``prompt_progress`` and nothing else;
  without it, no chunk has one.
- HTTP, through OpenAI's client: ``return_progress`` on a stream gives llama-server's
  ``prompt_progress`` chunks (total, cache, processed, time_ms) before the first token, on
  chat and legacy completions; on a whole reply it is refused with a 400.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import openai
import pytest
from daemons import GREEDY, InProcessDaemon

import kvkeep
from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeep.v1 import kvkeep_pb2_grpc as pb_grpc

BATCH = 32
SYSTEM = "You are a careful reader. You answer in one short sentence."
# About 300 tokens: ten batches of 32.
LONG = (
    " ".join(
        f"Ship {i} left pier {i % 9} at {i % 12} o'clock carrying {i * 3} barrels of salt."
        for i in range(1, 21)
    )
    + " Which ship carried the most barrels?"
)


@pytest.fixture(scope="module")
def small_batches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """A daemon that evaluates 32 tokens a step, serving HTTP too."""
    d = InProcessDaemon.with_settings(
        tmp_path_factory.mktemp("progress"), batch_size=BATCH, http_address="127.0.0.1:0"
    )
    yield d
    d.stop()


def check_reports(reports: Sequence[kvkeep.PromptProgress]) -> None:
    """One report as the evaluation begins, one per batch after it; processed grows to the total."""
    first, last = reports[0], reports[-1]
    assert first.processed == first.cached
    assert last.processed == last.total
    assert last.fraction == 1.0
    assert all(p.total == first.total and p.cached == first.cached for p in reports)
    steps = [b.processed - a.processed for a, b in itertools.pairwise(reports)]
    assert all(0 < s <= BATCH for s in steps), steps
    assert len(reports) == 1 + math.ceil((first.total - first.cached) / BATCH)
    times = [p.elapsed for p in reports]
    assert times == sorted(times) and times[0] >= 0


def test_the_sdk_reports_the_prompt_before_the_first_token(small_batches: InProcessDaemon) -> None:
    with kvkeep.Client(small_batches.address, timeout=60) as client:
        session = client.create_session(SYSTEM, sampling=GREEDY)
        reports: list[kvkeep.PromptProgress] = []
        chunks: list[kvkeep.Chunk] = []
        reported_before_first: int | None = None
        for chunk in session.chat_stream(LONG, max_tokens=4, on_progress=reports.append):
            if reported_before_first is None:
                reported_before_first = len(reports)
            chunks.append(chunk)
        assert reported_before_first == len(reports)  # all of them before the first chunk
        check_reports(reports)
        usage = chunks[-1].usage
        assert usage is not None
        assert reports[0].cached == usage.reused_tokens
        history = session.info().n_tokens
        assert reports[-1].total == history - usage.generated_tokens
        assert reports[-1].total >= 300
        assert len(reports) >= 9  # several reports for one prompt
        assert reports[-1].evaluated == reports[-1].total - usage.reused_tokens

        # The next turn reuses the history it follows: counted as cached, not evaluated.
        again: list[kvkeep.PromptProgress] = []
        reply = session.chat("And the fewest?", max_tokens=4, on_progress=again.append)
        check_reports(again)
        assert again[0].cached == reply.usage.reused_tokens
        assert again[0].cached >= history - 1
        assert again[-1].total == session.info().n_tokens - reply.usage.generated_tokens
        assert again[-1].evaluated < 32

        # The same request without on_progress gives the same reply.
        plain = client.create_session(SYSTEM, sampling=GREEDY).chat(LONG, max_tokens=4)
        assert plain.token_ids == tuple(t for c in chunks for t in c.token_ids)


def test_the_async_sdk_reports_generate_and_complete(small_batches: InProcessDaemon) -> None:
    async def run() -> tuple[list[kvkeep.PromptProgress], list[kvkeep.PromptProgress], int]:
        async with kvkeep.AsyncClient(small_batches.address, timeout=60) as client:
            session = await client.create_session(sampling=GREEDY)
            streamed: list[kvkeep.PromptProgress] = []
            tokens_when_reported: list[int] = []
            n_tokens = 0

            def note(p: kvkeep.PromptProgress) -> None:
                streamed.append(p)
                tokens_when_reported.append(n_tokens)

            async for chunk in session.generate(LONG, max_tokens=3, on_progress=note):
                n_tokens += len(chunk.token_ids)
            assert set(tokens_when_reported) == {0}
            completed: list[kvkeep.PromptProgress] = []
            done = await session.complete(" Then", max_tokens=3, on_progress=completed.append)
            return streamed, completed, done.usage.reused_tokens

    streamed, completed, reused = asyncio.run(run())
    check_reports(streamed)
    assert streamed[0].cached == 0  # a session with no history: nothing to reuse
    check_reports(completed)
    # The history it follows: the prompt before, and what was generated after it.
    assert completed[0].cached == reused >= streamed[-1].total


def test_grpc_progress_chunks_carry_nothing_else(small_batches: InProcessDaemon) -> None:
    with grpc.insecure_channel(small_batches.address) as channel:
        stub = pb_grpc.KvKeepStub(channel)
        made = stub.CreateSession(pb.CreateSessionRequest(system_prompt=SYSTEM))
        session_id = made.session.session_id
        asked = list(
            stub.Chat(pb.ChatRequest(session_id=session_id, message=LONG, max_tokens=2, return_progress=True))
        )
        progress = [r.chunk for r in asked if r.chunk.HasField("prompt_progress")]
        assert len(progress) >= 2
        for c in progress:
            assert (c.text, list(c.token_ids), c.finish_reason, c.HasField("usage")) == ("", [], 0, False)
        # All of them before the first token.
        first_token = next(i for i, r in enumerate(asked) if r.chunk.token_ids)
        assert all(r.chunk.HasField("prompt_progress") for r in asked[:first_token])
        assert progress[-1].prompt_progress.processed == progress[-1].prompt_progress.total
        # Not asked, none.
        plain = list(stub.Chat(pb.ChatRequest(session_id=session_id, message="More?", max_tokens=2)))
        assert plain and not any(r.chunk.HasField("prompt_progress") for r in plain)
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id))


def openai_client(d: InProcessDaemon) -> openai.OpenAI:
    assert d.daemon is not None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{d.daemon.http_port}/v1", api_key="unused")


def check_http_reports(extras: Sequence[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The chunks' prompt_progress fields: all before the first token, as llama-server has them."""
    reports = [e["prompt_progress"] for e in extras if e and "prompt_progress" in e]
    assert len(reports) >= 2
    assert all(e is not None and "prompt_progress" in e for e in extras[: len(reports)])
    assert all(set(r) == {"total", "cache", "processed", "time_ms"} for r in reports)
    processed = [r["processed"] for r in reports]
    assert processed == sorted(processed)
    assert processed[0] == reports[0]["cache"] and processed[-1] == reports[-1]["total"]
    return reports


def test_http_streams_report_progress_as_llama_server(small_batches: InProcessDaemon) -> None:
    client = openai_client(small_batches)
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG}]
    stream = client.chat.completions.create(
        model="any",
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_progress": True},
    )
    chunks = list(stream)
    reports = check_http_reports([c.model_extra for c in chunks])
    progress_chunks = chunks[: len(reports)]
    assert all(
        c.choices[0].delta.role == "assistant" and not c.choices[0].delta.content for c in progress_chunks
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks[len(reports) :] if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == reports[-1]["total"]
    assert len(reports) == 1 + math.ceil((reports[-1]["total"] - reports[0]["cache"]) / BATCH)

    # Legacy completions too.
    completion = client.completions.create(
        model="any", prompt=LONG, max_tokens=2, stream=True, extra_body={"return_progress": True}
    )
    check_http_reports([c.model_extra for c in completion])

    # Not asked: no chunk has it.
    plain = client.chat.completions.create(model="any", messages=messages, max_tokens=2, stream=True)
    assert not any((c.model_extra or {}).get("prompt_progress") for c in plain)


def test_http_refuses_progress_on_a_whole_reply(small_batches: InProcessDaemon) -> None:
    client = openai_client(small_batches)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"return_progress": True},
        )
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "return_progress"
    assert "stream" in body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model="any", prompt="Hi", max_tokens=2, extra_body={"return_progress": True}
        )
