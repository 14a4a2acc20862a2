"""The OpenAI-compatible HTTP door, through OpenAI's own client and raw HTTP.

- Chat and legacy completions, streamed and not, and the model list.
- A resent conversation continues the session the door kept for it (cached_tokens counts the
  history); another conversation with the same system prompt attaches its cached blocks; the
  door keeps a bounded number of sessions per tenant.
- `session_id` continues a kvkeep session: the same tokens and logprobs as the gRPC path.
- Auth as over gRPC (401), another tenant's session 404, the tenant's session quota.
- Bad input (malformed JSON, wrong types, oversized bodies, unsupported fields) gets a 4xx
  with an OpenAI error body; the daemon goes on serving.
- `kvkeep serve --http`, and SIGTERM with a stream in flight.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tlscerts
from auth import TOKENS, write_auth
from daemons import GREEDY, DaemonProcess, InProcessDaemon, check_serving, model_path, wait_until

import kvkeep
from kvkeepd.api.http.keep import PER_TENANT
from kvkeepd.config.settings import ConfigError, Settings

MODEL = model_path().stem
SYSTEM = (
    "You are the archivist of a harbour town. You answer in one short sentence, you never "
    "invent facts, and when you do not know something you say so plainly. The town keeps "
    "ledgers of ships, tides, storms, cargo and the names of every pier; pier 7 holds the "
    "lighthouse keeper's boat and pier 3 the ferry. Be precise and polite."
)
BODY_LIMIT = 1 << 16
# Tokens a generation may run past the point where its client left (see test_cancel.py).
RUN_AHEAD = 24


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """A daemon that also serves HTTP (a small body limit, so oversized bodies are cheap)."""
    d = InProcessDaemon.with_settings(
        tmp_path_factory.mktemp("http"), http_address="127.0.0.1:0", max_message_bytes=BODY_LIMIT
    )
    yield d
    d.stop()


def base_url(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}/v1"


@pytest.fixture
def oai(door: InProcessDaemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url(door), api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def grpc_client(door: InProcessDaemon) -> Iterator[kvkeep.Client]:
    with kvkeep.Client(door.address, timeout=60) as c:
        yield c


def chat(oai: openai.OpenAI, messages: list[dict[str, str]], **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=messages, **{"temperature": 0, **kw})  # type: ignore[arg-type]


def test_models_lists_the_loaded_model_and_any_name_reaches_it(
    oai: openai.OpenAI, door: InProcessDaemon
) -> None:
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    # One model is served: whatever name a client has written in, it answers, by that name.
    hi = [{"role": "user", "content": "Hi"}]
    named = oai.chat.completions.create(model="gpt-4o", messages=hi, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert named.model == "gpt-4o" and named.choices[0].message.content
    unnamed = raw(
        door, "/chat/completions", {"messages": hi, "max_tokens": 2}, **{"content-type": "application/json"}
    )
    assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL


def test_health_and_ready_answer_anyone(door: InProcessDaemon) -> None:
    for path in ("/health", "/ready"):
        r = httpx.get(base_url(door).removesuffix("/v1") + path, timeout=10)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_chat_streamed_and_not_give_the_same_reply(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = chat(oai, messages, max_tokens=12)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(chat(oai, messages, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_client_that_leaves_a_stream_stops_it(
    oai: openai.OpenAI, door: InProcessDaemon, grpc_client: kvkeep.Client
) -> None:
    # Greedy, this reply runs on to max_tokens (400) unless the generation is stopped.
    numbers = [{"role": "user", "content": "Write the numbers from 1 to 500, separated by commas."}]
    before = grpc_client.info().tokens_generated
    stream = chat(oai, numbers, max_tokens=400, stream=True)
    first = next(iter(stream))
    stream.close()
    assert first.choices[0].finish_reason is None
    assert door.daemon is not None
    door.run(door.daemon.manager.settle(), timeout=60)  # the request's operation has ended
    generated = grpc_client.info().tokens_generated - before
    # The engine finishes the step in flight and may run a few ahead of what was sent, as
    # over gRPC (test_cancel.py); 400 would mean it never stopped.
    assert 1 <= generated < RUN_AHEAD


def test_completions_streamed_and_not(oai: openai.OpenAI) -> None:
    whole = oai.completions.create(model=MODEL, prompt="The tide came in", max_tokens=6, temperature=0)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    streamed = oai.completions.create(
        model=MODEL, prompt="The tide came in", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    # Legacy completions give 16 tokens unless asked for more, as OpenAI's do.
    default = oai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert default.usage.completion_tokens <= 16


def test_stop_max_tokens_seed_and_logprobs(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Write the numbers 1 to 20 separated by commas."}]
    free = chat(oai, messages, max_tokens=40).choices[0].message.content
    assert "5" in free
    cut = chat(oai, messages, max_tokens=40, stop=["5"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == free[: free.index("5")]
    short = chat(oai, messages, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3

    sampled = [
        chat(oai, messages, max_tokens=12, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]

    lp = chat(oai, messages, max_tokens=5, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert len(lp) == 5
    for token in lp:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.logprob  # greedy: the best one was drawn
    only = chat(oai, messages, max_tokens=2, logprobs=True).choices[0].logprobs.content
    assert all(t.top_logprobs == [] for t in only)
    legacy = oai.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2)
    assert legacy.choices[0].logprobs is not None
    assert len(legacy.choices[0].logprobs.tokens) == 3
    assert all(len(t) <= 2 for t in legacy.choices[0].logprobs.top_logprobs)


def test_response_format_constrains_the_reply(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a cat."}]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "legs": {"type": "integer"}},
        "required": ["name", "legs"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}}
    reply = chat(oai, messages, max_tokens=60, response_format=fmt).choices[0]
    assert reply.finish_reason == "stop"
    value = json.loads(reply.message.content or "")
    assert set(value) == {"name", "legs"} and isinstance(value["legs"], int)
    obj = chat(oai, messages, max_tokens=60, response_format={"type": "json_object"}).choices[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content or ""), dict)


def test_a_resent_conversation_is_not_evaluated_again(oai: openai.OpenAI, grpc_client: kvkeep.Client) -> None:
    """A plain OpenAI client resends everything; the door continues the session it kept, and
    the replies are the gRPC path's."""
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is at pier 7?"}]
    first = chat(oai, conversation, max_tokens=16)
    assert first.usage.prompt_tokens_details.cached_tokens < 64
    conversation += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And at pier 3?"},
    ]
    second = chat(oai, conversation, max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens > cached

    reference = grpc_client.create_session(SYSTEM, sampling=GREEDY)
    try:
        assert reference.chat("What is at pier 7?", max_tokens=16).text == first.choices[0].message.content
        assert reference.chat("And at pier 3?", max_tokens=16).text == second.choices[0].message.content
    finally:
        reference.close()

    # Another conversation with the same system prompt attaches its cached blocks.
    other = chat(
        oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any storms?"}], max_tokens=4
    )
    assert other.usage.prompt_tokens_details.cached_tokens >= 64


def test_session_id_continues_a_session_exactly(oai: openai.OpenAI, grpc_client: kvkeep.Client) -> None:
    """Over HTTP with session_id, only the new message is sent: the same tokens (and logprobs)
    as gRPC's Chat on a twin session."""
    twins = [grpc_client.create_session(SYSTEM, sampling=GREEDY) for _ in range(2)]
    try:
        questions = ["What is at pier 7?", "Who uses it?", "And pier 3?"]
        for turn, q in enumerate(questions):
            over_grpc = twins[0].chat(q, max_tokens=12, logprobs=1)
            over_http = chat(
                oai,
                [{"role": "user", "content": q}],
                max_tokens=12,
                logprobs=True,
                extra_body={"session_id": twins[1].session_id},
            )
            assert over_http.model_extra["session_id"] == twins[1].session_id
            choice = over_http.choices[0]
            assert choice.message.content == over_grpc.text
            # gRPC carries logprobs as float32, JSON as the float64 they were computed in.
            http_logprobs = [float(np.float32(t.logprob)) for t in choice.logprobs.content]
            assert http_logprobs == [g.sampled.logprob for g in over_grpc.logprobs]
            assert over_http.usage.completion_tokens == over_grpc.usage.generated_tokens
            cached = over_http.usage.prompt_tokens_details.cached_tokens
            if turn == 0:
                # The first turn may also attach the blocks its gRPC twin has just computed.
                assert cached >= over_grpc.usage.reused_tokens
            else:  # later turns each continue their own session's history
                assert cached == over_grpc.usage.reused_tokens
        a, b = twins[0].info(), twins[1].info()
        assert a.n_tokens == b.n_tokens and a.messages == b.messages
    finally:
        for s in twins:
            s.close()


def test_a_new_session_over_http(oai: openai.OpenAI, grpc_client: kvkeep.Client) -> None:
    start = chat(
        oai,
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=6,
        extra_body={"session_id": "new", "persistent": True},
    )
    session_id = start.model_extra["session_id"]
    assert grpc_client.session(session_id).info().persistent
    more = chat(
        oai, [{"role": "user", "content": "Another."}], max_tokens=6, extra_body={"session_id": session_id}
    )
    assert more.usage.prompt_tokens_details.cached_tokens >= start.usage.prompt_tokens
    info = grpc_client.session(session_id).info()
    assert [m.role for m in info.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert info.messages[2].content == start.choices[0].message.content
    streamed = list(
        oai.completions.create(
            model=MODEL, prompt=" More:", max_tokens=3, stream=True, extra_body={"session_id": session_id}
        )
    )
    assert streamed[0].model_extra["session_id"] == session_id
    assert grpc_client.session(session_id).info().n_tokens > info.n_tokens
    grpc_client.session(session_id).close()


def test_usage_counts_the_whole_prompt_on_every_door(oai: openai.OpenAI, grpc_client: kvkeep.Client) -> None:
    """The same second turn over gRPC, chat completions and the Responses API: each says the
    prompt is the whole conversation so far (its tokens: the context after the turn less the
    reply), of which the cached part was not evaluated again."""
    questions = ["What is at pier 7?", "And at pier 3?"]
    session = grpc_client.create_session(SYSTEM, sampling=GREEDY)
    try:
        first = session.chat(questions[0], max_tokens=8)
        n_first = session.info().n_tokens
        second = session.chat(questions[1], max_tokens=8)
        over_grpc = second.usage
        # The whole prompt, not only the tokens this turn added to it.
        assert over_grpc.prompt_tokens == session.info().n_tokens - over_grpc.generated_tokens
        assert over_grpc.prompt_tokens == n_first + over_grpc.added_tokens
        assert over_grpc.prompt_tokens == over_grpc.reused_tokens + over_grpc.evaluated_tokens
        assert over_grpc.reused_tokens == n_first - 1  # all but the last reply token, never decoded
        assert over_grpc.evaluated_tokens == over_grpc.added_tokens + 1

        # A third turn over HTTP on the same session: its prompt is the session's too.
        third = chat(
            oai,
            [{"role": "user", "content": "Who uses it?"}],
            max_tokens=8,
            extra_body={"session_id": session.session_id},
        ).usage
        assert third.prompt_tokens == session.info().n_tokens - third.completion_tokens
        assert (
            third.prompt_tokens_details.cached_tokens
            == over_grpc.prompt_tokens + over_grpc.generated_tokens - 1
        )
    finally:
        session.close()

    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": questions[0]}]
    assert chat(oai, conversation, max_tokens=8).choices[0].message.content == first.text
    conversation += [{"role": "assistant", "content": first.text}, {"role": "user", "content": questions[1]}]
    over_chat = chat(oai, conversation, max_tokens=8).usage
    assert over_chat.prompt_tokens == over_grpc.prompt_tokens
    assert over_chat.total_tokens == over_chat.prompt_tokens + over_chat.completion_tokens
    assert over_chat.prompt_tokens_details.cached_tokens == over_grpc.reused_tokens

    asked = {"model": MODEL, "instructions": SYSTEM, "temperature": 0, "max_output_tokens": 8}
    started = oai.responses.create(input=questions[0], **asked)  # type: ignore[call-overload]
    assert started.output_text == first.text
    over_responses = oai.responses.create(input=questions[1], previous_response_id=started.id, **asked).usage  # type: ignore[call-overload]
    assert over_responses is not None
    assert over_responses.input_tokens == over_grpc.prompt_tokens
    assert over_responses.input_tokens_details.cached_tokens == over_grpc.reused_tokens
    assert over_responses.output_tokens == over_grpc.generated_tokens


def test_the_door_keeps_a_bounded_number_of_sessions(start_daemon: Any) -> None:
    # A daemon of its own: the module's shared one also holds the sessions of stored responses.
    d = start_daemon(http_address="127.0.0.1:0")
    with (
        openai.OpenAI(base_url=base_url(d), api_key="unused", max_retries=0, timeout=120) as oai,
        kvkeep.Client(d.address, timeout=60) as grpc_client,
    ):
        for i in range(PER_TENANT + 2):
            chat(oai, [{"role": "user", "content": f"Say {i}."}], max_tokens=1)
        # The oldest are closed (in the background) beyond the bound.
        wait_until(lambda: len(grpc_client.list_sessions()) == PER_TENANT, 30, "the keep's bound")


def raw(d: InProcessDaemon, path: str, body: bytes | str | dict[str, Any], **headers: str) -> httpx.Response:
    """POST these bytes, as JSON unless `headers` say otherwise."""
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"content-type": "application/json", **headers}
    return httpx.post(base_url(d) + path, content=content, headers=headers, timeout=120)


def test_bad_input_gets_a_4xx_and_the_daemon_goes_on(
    door: InProcessDaemon, grpc_client: kvkeep.Client
) -> None:
    hello = [{"role": "user", "content": "Hi"}]
    ok = {"model": MODEL, "messages": hello, "max_tokens": 1}
    cases: list[tuple[bytes | str | dict[str, Any], int, str]] = [
        (b"{not json", 400, "JSON"),
        (b"[1, 2]", 400, ""),
        ("", 400, ""),
        ({"model": MODEL}, 400, "messages"),
        ({**ok, "messages": "Hi"}, 400, "messages"),
        ({**ok, "messages": []}, 400, "messages"),
        ({**ok, "temperature": "hot"}, 400, "temperature"),
        ({**ok, "max_tokens": True}, 400, "max_tokens"),
        ({**ok, "max_tokens": 0}, 400, "max_tokens"),
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "top_p": 0}, 400, "top_p"),
        ({**ok, "stop": [""]}, 400, "stop"),
        ({**ok, "messages": [{"role": "function", "content": "x"}]}, 400, "role"),
        ({**ok, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ""),
        ({**ok, "n": 2}, 400, "n must be 1"),
        ({**ok, "tools": [{"type": "function"}]}, 400, "tools"),
        ({**ok, "response_format": {"type": "xml"}}, 400, "not supported"),
        ({**ok, "response_format": {"type": "json_schema", "json_schema": {}}}, 400, "json_schema.schema"),
        ({**ok, "top_logprobs": 99, "logprobs": True}, 400, "top_logprobs"),
        ({**ok, "messages": [{"role": "system", "content": "Only a system prompt."}]}, 400, "no message"),
        ({**ok, "max_tokens": 5000}, 400, "context"),
        ({**ok, "session_id": "nope"}, 400, "malformed session id"),
        ({**ok, "persistent": True}, 400, "persistent goes with"),
        ({**ok, "session_id": "s_" + "0" * 24}, 404, "no session"),
        (b"x" * (BODY_LIMIT + 1), 413, "larger than the limit"),
    ]
    for body, status, words in cases:
        r = raw(door, "/chat/completions", body, **{"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"], (body, error)

    completions = [
        ({"model": MODEL, "prompt": 7}, 400),
        ({"model": MODEL, "prompt": ""}, 400),
        ({"model": MODEL, "prompt": [10**9]}, 400),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400),
        ({"model": MODEL, "prompt": "x", "echo": True}, 400),
    ]
    for body, status in completions:
        assert raw(door, "/completions", body).status_code == status, body
    # An oversized body that does not say its length is cut off as it arrives.
    chunked = httpx.post(
        base_url(door) + "/chat/completions", content=iter([b"x" * 40_000, b"y" * 40_000]), timeout=60
    )
    assert chunked.status_code == 413
    assert httpx.get(base_url(door) + "/nowhere").status_code == 404
    assert httpx.get(base_url(door) + "/chat/completions").status_code == 405
    # A streamed request that fails before its first chunk gets its status, not a broken stream.
    assert raw(door, "/chat/completions", {**ok, "stream": True, "max_tokens": 5000}).status_code == 400

    # A session made for a request that failed is closed: the client never learnt its id.
    before = len(grpc_client.list_sessions())
    assert raw(door, "/chat/completions", {**ok, "session_id": "new", "max_tokens": 5000}).status_code == 400
    assert (
        raw(
            door, "/completions", {"model": MODEL, "prompt": "x", "session_id": "new", "max_tokens": 5000}
        ).status_code
        == 400
    )
    assert len(grpc_client.list_sessions()) == before

    check_serving(grpc_client)
    assert raw(door, "/chat/completions", ok).status_code == 200


def test_without_an_auth_file_the_http_door_stays_local(tmp_path: Path) -> None:
    def settings(**kw: Any) -> Settings:
        return Settings(model_path=model_path(), state_dir=tmp_path, **kw)

    with pytest.raises(ConfigError, match="loopback"):
        settings(http_address="0.0.0.0:8080").validate()
    with pytest.raises(ConfigError, match="host:port"):
        settings(http_address="localhost").validate()
    settings(http_address="127.0.0.1:8080").validate()
    settings(http_address="0.0.0.0:8080", auth_file=write_auth(tmp_path / "auth.toml", TOKENS)).validate()


#: The CA that signed each TLS daemon's certificate.
CA: dict[InProcessDaemon, Path] = {}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    """Two tenants over HTTP and TLS; alice may hold two sessions."""
    root = tmp_path_factory.mktemp("http-tenants")
    certs = tlscerts.make(root)
    d = InProcessDaemon.with_settings(
        root / "state",
        http_address="127.0.0.1:0",
        auth_file=write_auth(root / "auth.toml", TOKENS, {"alice": {"max_sessions": 2}}),
        tls_cert=certs.server.cert,
        tls_key=certs.server.key,
        slots=2,
    )
    CA[d] = certs.ca
    yield d
    d.stop()


def ssl_context(d: InProcessDaemon) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(CA[d]))


def tenant_client(d: InProcessDaemon, token: str) -> openai.OpenAI:
    assert d.daemon is not None
    http = httpx.Client(verify=ssl_context(d))
    url = f"https://localhost:{d.daemon.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=120, http_client=http)


def test_auth_tenants_and_quotas_over_http(tenants: InProcessDaemon) -> None:
    hello = [{"role": "user", "content": "Hi"}]
    with (
        tenant_client(tenants, "wrong-token-0123456789") as nobody,
        pytest.raises(openai.AuthenticationError),
    ):
        chat(nobody, hello, max_tokens=1)
    assert tenants.daemon is not None
    url = f"https://localhost:{tenants.daemon.http_port}/v1/chat/completions"
    body = {"model": MODEL, "messages": hello}
    for headers in ({}, {"authorization": "Basic abc"}, {"authorization": "Bearer"}):
        r = httpx.post(url, json=body, headers=headers, verify=ssl_context(tenants))
        assert r.status_code == 401 and "bearer token" in r.json()["error"]["message"]
    with tenant_client(tenants, TOKENS["bob"]) as bob:
        with pytest.raises(openai.AuthenticationError):
            tenant_client(tenants, "x" * 20).models.list()
        bobs = chat(bob, hello, max_tokens=1, extra_body={"session_id": "new"}).model_extra["session_id"]

    with (
        tenant_client(tenants, TOKENS["alice"]) as alice,
        kvkeep.Client(tenants.address, token=TOKENS["alice"], tls=kvkeep.Tls(ca_file=CA[tenants])) as grpc,
    ):
        # Another tenant's session is not found, as an unknown one is.
        with pytest.raises(openai.NotFoundError, match="no session"):
            chat(alice, hello, max_tokens=1, extra_body={"session_id": bobs})
        # At the tenant's quota of 2 (and no kept session to close), a new conversation is 429.
        mine = [grpc.create_session() for _ in range(2)]
        with pytest.raises(openai.RateLimitError, match="quota"):
            chat(alice, hello, max_tokens=1)
        mine.pop().close()
        # The door's kept sessions make room when the quota is reached.
        for i in range(3):
            chat(alice, [{"role": "user", "content": f"Say {i}."}], max_tokens=1)
        assert len(grpc.list_sessions()) == 2
        mine[0].close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_http_flag_and_sigterm(spawn_daemon: Any) -> None:
    port = free_port()
    d: DaemonProcess = spawn_daemon("--http", f"127.0.0.1:{port}")
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as c:
        assert c.models.list().data[0].id == MODEL
        stream = chat(c, [{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)
        assert list(stream)[-1].choices[0].finish_reason in ("stop", "length")
    # SIGTERM while a stream is in flight: the door drains (within the grace period) before
    # the session manager shuts down, and the daemon exits cleanly; the client never hangs.
    started, ended = threading.Event(), threading.Event()

    def consume() -> None:
        try:
            with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as c:
                stream = chat(
                    c, [{"role": "user", "content": "Count to one hundred."}], max_tokens=300, stream=True
                )
                for _ in stream:
                    started.set()
        except openai.APIError:
            pass
        finally:
            started.set()
            ended.set()

    threading.Thread(target=consume, daemon=True).start()
    assert started.wait(120)
    assert d.terminate(timeout=60) == 0
    assert ended.wait(30)
    assert f"OpenAI-compatible HTTP on http://127.0.0.1:{port}/v1" in d.log()
    assert "Traceback" not in d.log()
