"""Streams open before the prompt is evaluated and keep alive while it is: an agent's long
prompt on a slow CPU must not look like a dead connection to a client's idle timeout (Codex
CLI's is reset only by events with data, not by SSE comments).

What is checked, on each of /v1/responses, /v1/chat/completions and /v1/messages, with a
prompt of some 700 tokens evaluated afresh on one thread: the stream's first event arrives
within a fraction of the time its first token takes, heartbeat events of the API's own
(`response.in_progress` again, a chunk with an empty delta, `ping`) come at the daemon's
`--http-heartbeat` interval until the first token, and the reply that follows is whole.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
# A chat chunk that says nothing, as a heartbeat is (its delta aside).
EMPTY = {"index": 0, "logprobs": None, "finish_reason": None}
HEARTBEAT = 0.25
# Some 700 tokens: seconds of evaluation on one thread, many times HEARTBEAT.
WORDS = 640


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(
        tmp_path_factory.mktemp("heartbeats") / "state",
        http_address="127.0.0.1:0",
        ctx_per_session=4096,
        http_heartbeat=HEARTBEAT,
    )
    yield d
    d.stop()


def long_prompt() -> str:
    """A prompt no cache holds: its first words are new each time."""
    words = [f"w{secrets.token_hex(3)}" for _ in range(8)] + ["apple", "river", "stone", "cloud"] * (
        WORDS // 4
    )
    return "Read these words, then say hello. " + " ".join(words)


def timed_events(
    door: InProcessDaemon, path: str, body: dict[str, Any]
) -> list[tuple[float, dict[str, Any]]]:
    """Each event's data (JSON) of a streamed request, with the seconds since it was sent."""
    assert door.daemon is not None
    out: list[tuple[float, dict[str, Any]]] = []
    url = f"http://127.0.0.1:{door.daemon.http_port}{path}"
    headers = {"x-api-key": "any", "anthropic-version": "2023-06-01"}
    began = time.monotonic()
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append((time.monotonic() - began, json.loads(line[len("data: ") :])))
    return out


def check_opening(events: list[tuple[float, dict[str, Any]]], is_beat: Any, api: str) -> None:
    """The first event came long before the reply's first token (the first event after the
    opening that is no heartbeat), and heartbeats filled the wait."""
    first_token = next(t for t, e in events[1:] if not is_beat(e))
    beats = [t for t, e in events[1:] if t < first_token]
    print(
        f"{api}: first event at {events[0][0]:.3f} s, first token at {first_token:.3f} s, "
        f"{len(beats)} heartbeats"
    )
    assert events[0][0] < first_token / 2, (api, events[0][0], first_token)
    # One every HEARTBEAT seconds of the wait, give or take what a busy machine delays.
    assert len(beats) >= (first_token - events[0][0]) / HEARTBEAT / 3, (api, beats, first_token)


def test_a_responses_stream_opens_at_once_and_beats_until_its_first_token(door: InProcessDaemon) -> None:
    body = {"model": MODEL, "input": long_prompt(), "stream": True, "max_output_tokens": 4, "temperature": 0}
    events = timed_events(door, "/v1/responses", body)
    kinds = [e["type"] for _, e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    check_opening(events, lambda e: e["type"] == "response.in_progress", "responses")
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert events[-1][1]["response"]["usage"]["input_tokens"] > WORDS


def test_a_chat_completions_stream_opens_at_once_and_beats_until_its_first_token(
    door: InProcessDaemon,
) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": long_prompt()}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
        "temperature": 0,
    }
    events = timed_events(door, "/v1/chat/completions", body)
    assert events[0][1]["choices"][0]["delta"]["role"] == "assistant"
    check_opening(events, lambda e: e["choices"][0] == {**EMPTY, "delta": e["choices"][0]["delta"]}, "chat")
    assert all(e["choices"][0]["delta"] == {"content": ""} for _, e in events[1:3]), events[:3]
    # Nothing the client did not ask for: no progress report rides along.
    assert not any("prompt_progress" in e for _, e in events)
    assert events[-1][1]["usage"]["prompt_tokens"] > WORDS


def test_a_messages_stream_opens_at_once_and_pings_until_its_first_token(door: InProcessDaemon) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": long_prompt()}],
        "stream": True,
        "max_tokens": 4,
        "temperature": 0,
    }
    events = timed_events(door, "/v1/messages", body)
    assert events[0][1]["type"] == "message_start"
    check_opening(events, lambda e: e["type"] == "ping", "messages")
    assert events[-1][1]["type"] == "message_stop"
