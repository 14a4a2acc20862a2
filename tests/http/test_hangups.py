"""A client that hangs up before its reply: the access log says 499 (nginx's "client closed
request") with the reason `client_closed_request`, not a 400 nobody sent, and the
conversation it was continuing is kept as it was.

What is checked, with a prompt long enough (some 700 tokens on one thread) that the client
gives up while it is evaluated: a named session's request (chat completions), a
conversation sent whole (chat completions and the Messages API, answered in the door's kept
sessions) and a stream whose client leaves before its first event; each is logged 499
client_closed_request, and the next request of the same conversation is served and reads
again all that the conversation held before the hang-up.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from accesslog import access_lines, await_lines
from daemons import InProcessDaemon, model_path, wait_until

MODEL = model_path().stem
# Tokens of a turn's end that the next turn renders again rather than reads.
SLACK = 4


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(
        tmp_path_factory.mktemp("hangups") / "state", http_address="127.0.0.1:0", ctx_per_session=2048
    )
    yield d
    d.stop()


def url(door: InProcessDaemon, path: str) -> str:
    assert door.daemon is not None
    return f"http://127.0.0.1:{door.daemon.http_port}{path}"


def post(door: InProcessDaemon, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url(door, path), json=body, headers={"x-api-key": "any"}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def long_message() -> dict[str, str]:
    """A user message of some 700 tokens that no cache holds: seconds of evaluation."""
    words = [f"w{secrets.token_hex(3)}" for _ in range(8)] + ["apple", "river", "stone", "cloud"] * 160
    return {"role": "user", "content": "Read these words. " + " ".join(words)}


def hang_up(door: InProcessDaemon, path: str, body: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str:
    """Send `body`, give up after half a second, and return the request's access line."""
    before = len(access_lines(caplog))
    with pytest.raises(httpx.ReadTimeout):
        if body.get("stream"):
            with httpx.stream(
                "POST", url(door, path), json=body, headers={"x-api-key": "any"}, timeout=0.5
            ) as r:
                r.read()
        else:
            httpx.post(url(door, path), json=body, headers={"x-api-key": "any"}, timeout=0.5)
    # An earlier request's line may come in meanwhile (each is written after its reply has
    # gone, from the door's thread): the hang-up's is the one that is no 200.
    lines = await_lines(caplog, lambda ls: any(not x.endswith(" 200") for x in ls[before:]), timeout=60)
    left = [x for x in lines[before:] if not x.endswith(" 200")]
    assert len(left) == 1, lines[before:]
    return left[0]


def settled(door: InProcessDaemon) -> None:
    """Until the engine step a hang-up fell in ends (seconds of the long prompt on one
    thread), its session is busy, and a request that comes meanwhile starts another."""
    assert door.daemon is not None and door.daemon.manager is not None
    m = door.daemon.manager
    tenant = m.resolve_tenant(None)
    wait_until(lambda: not any(s.busy for s in m.owned(tenant)), 120, "the left turn's step to end")


def chat(messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **kw}


def held(reply: dict[str, Any]) -> int:
    """The tokens a chat reply leaves its conversation holding (its prompt and its reply)."""
    return int(reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"])


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_named_session_s_request_left_is_499_and_the_session_goes_on(
    door: InProcessDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    first = post(door, "/v1/chat/completions", chat([{"role": "user", "content": "Hi."}], session_id="new"))
    session = first["session_id"]
    with caplog.at_level(logging.INFO, logger="kvkeepd.access"):
        line = hang_up(door, "/v1/chat/completions", chat([long_message()], session_id=session), caplog)
        assert line.endswith(" 499 client_closed_request"), line
        assert f"session={session}" in line
        # A stream whose client leaves before its first event: the same.
        line = hang_up(
            door, "/v1/chat/completions", chat([long_message()], session_id=session, stream=True), caplog
        )
        assert line.endswith(" 499 client_closed_request"), line
    settled(door)
    after = post(
        door, "/v1/chat/completions", chat([{"role": "user", "content": "Again."}], session_id=session)
    )
    assert cached(after) >= held(first) - SLACK, (after["usage"], first["usage"])


def test_a_conversation_sent_whole_left_is_499_and_its_kept_session_goes_on(
    door: InProcessDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    system = {"role": "system", "content": f"You are terse. {secrets.token_hex(4)}"}
    history: list[dict[str, Any]] = [system, {"role": "user", "content": "Hi."}]
    first = post(door, "/v1/chat/completions", chat(history))
    history.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
    with caplog.at_level(logging.INFO, logger="kvkeepd.access"):
        line = hang_up(door, "/v1/chat/completions", chat([*history, long_message()]), caplog)
    assert line.endswith(" 499 client_closed_request"), line
    settled(door)
    after = post(door, "/v1/chat/completions", chat([*history, {"role": "user", "content": "Again."}]))
    assert cached(after) >= held(first) - SLACK, (after["usage"], first["usage"])


def test_a_messages_request_left_is_499_and_its_conversation_goes_on(
    door: InProcessDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    system = f"You are terse. {secrets.token_hex(4)}"
    history: list[dict[str, Any]] = [{"role": "user", "content": "Hi."}]
    body: dict[str, Any] = {"model": MODEL, "system": system, "max_tokens": 8, "temperature": 0}
    first = post(door, "/v1/messages", {**body, "messages": history})
    history.append({"role": "assistant", "content": first["content"]})
    with caplog.at_level(logging.INFO, logger="kvkeepd.access"):
        line = hang_up(door, "/v1/messages", {**body, "messages": [*history, long_message()]}, caplog)
    assert line.endswith(" 499 client_closed_request"), line
    settled(door)
    after = post(
        door, "/v1/messages", {**body, "messages": [*history, {"role": "user", "content": "Again."}]}
    )
    u = first["usage"]
    assert after["usage"]["cache_read_input_tokens"] >= u["input_tokens"] + u["output_tokens"] - SLACK, (
        after["usage"],
        u,
    )
