"""Anthropic's Messages API on the HTTP door, with Anthropic's own client.

What is checked: a message and its stream (the events in Anthropic's order, the same text as
the whole reply), stop reasons (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`) and
which of several stop sequences matched, structured outputs (`output_config.format`) held
to their schema, tool use (blocks held to their schema, streamed as `input_json_delta`s
that the client joins), a tool round trip continued in the door's kept session (usage says
what was read again and what was evaluated), `count_tokens` against a reply's usage,
`thinking` accepted, errors in Anthropic's envelope with its statuses, and tenants named by
`x-api-key` or a bearer token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
SYSTEM = "You are a helpful assistant. You answer in one short sentence."
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
TOOLS: list[dict[str, Any]] = [
    {"name": n, "description": f"{n} of a place.", "input_schema": s} for n, s in SCHEMAS.items()
]


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("anthropic"), http_address="127.0.0.1:0")
    yield d
    d.stop()


def base_url(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}"


@pytest.fixture
def claude(door: InProcessDaemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=base_url(door), api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def create(claude: anthropic.Anthropic, messages: list[dict[str, Any]], **kw: Any) -> Any:
    """A message, greedy: the client no longer has sampling parameters, so they travel as extra
    fields (older clients, Claude Code's among them, send them)."""
    sampling = {"temperature": 0, **kw.pop("sampling", {})}
    return claude.messages.create(model="claude-sonnet-4-5", messages=messages, extra_body=sampling, **kw)  # type: ignore[call-overload]


def few_shot() -> list[dict[str, Any]]:
    """Earlier turns in which the assistant called get_weather: the small model follows them."""
    out: list[dict[str, Any]] = []
    for city, degrees in (("Rome", 25), ("Oslo", 3), ("Lima", 18)):
        call = {"type": "tool_use", "id": f"toolu_{city}", "name": "get_weather"}
        out += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": [{**call, "input": {"city": city, "unit": "celsius"}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call["id"],
                        "content": json.dumps({"temperature": degrees}),
                    }
                ],
            },
            {"role": "assistant", "content": f"It is {degrees} degrees in {city}."},
        ]
    return out


def valid(block: Any) -> None:
    assert block.type == "tool_use" and block.id
    jsonschema.validate(block.input, SCHEMAS[block.name])


def test_a_message_and_its_stream_give_the_same_reply(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    system = [{"type": "text", "text": SYSTEM}]
    whole = create(claude, messages, system=system, max_tokens=12)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == "claude-sonnet-4-5"
    assert whole.id.startswith("msg_") and [b.type for b in whole.content] == ["text"]
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].text
    u = whole.usage
    assert 0 < u.output_tokens <= 12 and u.input_tokens > 0 and u.cache_creation_input_tokens == 0
    # The same conversation counted: what the reply's prompt took, read again or evaluated.
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system=system)  # type: ignore[arg-type]
    assert counted.input_tokens == u.input_tokens + (u.cache_read_input_tokens or 0)

    with claude.messages.stream(
        model=MODEL,
        messages=messages,
        system=system,
        max_tokens=12,
        extra_body={"temperature": 0},  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted.input_tokens


def test_stream_events_come_in_anthropic_s_order(door: InProcessDaemon) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 6,
        "stream": True,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    with httpx.stream("POST", f"{base_url(door)}/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start, ending = data[0]["message"], data[-2]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert ending["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    u = ending["usage"]
    assert (
        u["input_tokens"] + u["cache_read_input_tokens"]
        == start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]
    )
    assert 0 < u["output_tokens"] <= 6 and u["output_tokens"] >= len(data[3:-3])


def test_stop_reasons(claude: anthropic.Anthropic) -> None:
    count = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    short = create(claude, count, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    full = create(claude, count, max_tokens=60)
    text = full.content[0].text
    assert "5" in text
    stopped = create(claude, count, max_tokens=60, stop_sequences=["5"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"
    assert stopped.content[0].text == text[: text.index("5")]


def test_tool_use_held_to_its_schema_and_streamed_as_json_deltas(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "What is the weather in Oslo, and the time in Tokyo?"}]
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    options: dict[str, Any] = {"tools": TOOLS, "tool_choice": one_call, "max_tokens": 80}
    whole = create(claude, messages, **options)
    assert whole.stop_reason == "tool_use"
    calls = [b for b in whole.content if b.type == "tool_use"]
    assert len(calls) == 1
    valid(calls[0])
    named = create(claude, messages, **{**options, "tool_choice": {"type": "tool", "name": "get_time"}})
    assert named.stop_reason == "tool_use"
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    several = create(claude, messages, **{**options, "tool_choice": {"type": "any"}, "max_tokens": 200})
    done = [b for b in several.content if b.type == "tool_use"]
    for c in done if several.stop_reason == "tool_use" else done[:-1]:
        valid(c)

    with claude.messages.stream(
        model=MODEL, messages=messages, extra_body={"temperature": 0}, **options
    ) as stream:  # type: ignore[arg-type]
        raw = [e for e in stream if e.type in ("content_block_start", "content_block_delta")]
        final = stream.get_final_message()
    starts = [e.content_block for e in raw if e.type == "content_block_start"]
    assert [(s.type, s.name, s.input) for s in starts] == [("tool_use", calls[0].name, {})]  # type: ignore[union-attr]
    pieces = [e.delta for e in raw if e.type == "content_block_delta"]
    assert len(pieces) > 1 and all(p.type == "input_json_delta" for p in pieces)
    assert final.stop_reason == "tool_use"
    # The same call as the whole reply's (greedy), under its own id.
    assert [(b.type, b.id, b.input) for b in final.content] == [("tool_use", starts[0].id, calls[0].input)]  # type: ignore[union-attr]


def resent(block: dict[str, Any]) -> dict[str, Any]:
    """A block as a client may send it back: an input's keys in another order (a JSON object's
    order means nothing), which the door writes as the model did."""
    if block["type"] == "tool_use":
        block["input"] = dict(reversed(block["input"].items()))
    return block


def test_a_tool_round_trip_continues_the_kept_session(claude: anthropic.Anthropic) -> None:
    messages = [*few_shot(), {"role": "user", "content": "What is the weather in Paris?"}]
    first = create(claude, messages, tools=TOOLS[:1], system=SYSTEM, max_tokens=80)
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    valid(call)
    messages += [
        {"role": "assistant", "content": [resent(b.model_dump(exclude_none=True)) for b in first.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "21 C"}]}
            ],
        },
    ]
    answer = create(claude, messages, tools=TOOLS[:1], system=SYSTEM, max_tokens=24)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    # Only the result (and the reply's end) are new: the rest is read from the kept session.
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens
    assert answer.usage.cache_read_input_tokens >= before - 1
    assert answer.usage.input_tokens < 40
    # An error result is accepted as one.
    messages[-1]["content"][0] |= {"is_error": True}
    assert create(claude, messages, tools=TOOLS[:1], system=SYSTEM, max_tokens=4).content


CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "country": {"type": "string", "minLength": 1, "maxLength": 24},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}


def test_structured_outputs_hold_the_reply_to_its_json_schema(claude: anthropic.Anthropic) -> None:
    question: Any = [{"role": "user", "content": "What is the largest city of Japan?"}]
    output: Any = {"format": {"type": "json_schema", "schema": CITY_SCHEMA}}
    # Unconstrained, the model answers in words.
    free = create(claude, question, max_tokens=40).content[0].text
    with pytest.raises(ValueError):
        json.loads(free)
    # With output_config, the reply's text is JSON its schema allows, streamed or not.
    reply = create(claude, question, max_tokens=80, output_config=output)
    assert reply.stop_reason == "end_turn" and [b.type for b in reply.content] == ["text"]
    jsonschema.validate(json.loads(reply.content[0].text), CITY_SCHEMA)
    with claude.messages.stream(
        model=MODEL, messages=question, max_tokens=80, output_config=output, extra_body={"temperature": 0}
    ) as stream:
        assert stream.get_final_message().content[0].text == reply.content[0].text  # type: ignore[union-attr]
    # With tools: a call is held to its tool's schema, an answer to the output's.
    ask = [*few_shot(), {"role": "user", "content": "What is the weather in Paris?"}]
    both = create(claude, ask, tools=TOOLS[:1], max_tokens=80, output_config=output)
    for block in both.content:
        if block.type == "tool_use":
            valid(block)
        else:
            jsonschema.validate(json.loads(block.text), CITY_SCHEMA)
    assert both.stop_reason in ("tool_use", "end_turn")
    # A schema that cannot be compiled is refused, streamed or not.
    wrong: Any = {"format": {"type": "json_schema", "schema": {"type": "strang"}}}
    with pytest.raises(anthropic.BadRequestError, match="strang"):
        create(claude, question, max_tokens=8, output_config=wrong)
    with (
        pytest.raises(anthropic.BadRequestError, match="strang"),
        claude.messages.stream(model=MODEL, messages=question, max_tokens=8, output_config=wrong) as refused,
    ):
        list(refused)


def test_thinking_is_accepted_and_no_thinking_block_comes_out(claude: anthropic.Anthropic) -> None:
    reply = create(
        claude,
        [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there."}]}],
        max_tokens=4,
        thinking={"type": "enabled", "budget_tokens": 1024},
        metadata={"user_id": "someone"},
        sampling={"top_k": 20},
        extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    assert [b.type for b in reply.content] == ["text"]


def test_count_tokens_counts_what_is_added(claude: anthropic.Anthropic) -> None:
    short = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    longer = claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi " * 50}])
    tooled = claude.messages.count_tokens(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        tools=TOOLS,  # type: ignore[arg-type]
    )
    assert 0 < short.input_tokens < longer.input_tokens and tooled.input_tokens > short.input_tokens + 20


def test_stop_sequence_names_which_of_several_matched(claude: anthropic.Anthropic) -> None:
    count = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    text = create(claude, count, max_tokens=60).content[0].text
    assert text.index("5") < text.index("7")
    # The sequence that appears first stops the reply, wherever it is in the list.
    stops = ["7", "5", "never said"]
    stopped = create(claude, count, max_tokens=60, stop_sequences=stops)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "5"
    assert stopped.content[0].text == text[: text.index("5")]
    with claude.messages.stream(
        model=MODEL, messages=count, max_tokens=60, stop_sequences=stops, extra_body={"temperature": 0}
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == "5"
    assert streamed.content[0].text == stopped.content[0].text
    # Another list, another match: the sequence is the one that matched, not the first given.
    other = create(claude, count, max_tokens=60, stop_sequences=["9", "3."])
    assert other.stop_sequence == "3." and other.content[0].text == text[: text.index("3.")]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens: field required"),
        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
        (
            {"max_tokens": 4, "messages": [{"role": "assistant", "content": "Hi"}]},
            "last message must be the user",
        ),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": ""},
                            }
                        ],
                    }
                ],
            },
            "no vision",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": TOOLS,
                "tool_choice": {"type": "tool", "name": "get_stock"},
            },
            "'get_stock', which is none of the tools",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "input_schema",
        ),
    ],
)
def test_bad_requests_get_anthropic_s_envelope(
    door: InProcessDaemon, body: dict[str, Any], said: str
) -> None:
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    r = httpx.post(
        f"{base_url(door)}/v1/messages", json={"model": MODEL, **body}, headers=headers, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert said in r.json()["error"]["message"]


def test_the_client_s_errors(claude: anthropic.Anthropic) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError, match="no vision"):
        create(
            claude,
            [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "https://a/b.png"}}],
                }
            ],
            max_tokens=4,
        )
    with (
        pytest.raises(anthropic.BadRequestError, match="none of the tools"),
        claude.messages.stream(
            model=MODEL,
            messages=hi,
            max_tokens=4,
            tools=TOOLS,
            tool_choice={"type": "tool", "name": "nope"},  # type: ignore[arg-type]
        ) as stream,
    ):
        list(stream)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    root = tmp_path_factory.mktemp("anthropic-tenants")
    d = InProcessDaemon.with_settings(
        root / "state", http_address="127.0.0.1:0", auth_file=write_auth(root / "auth.toml", TOKENS)
    )
    yield d
    d.stop()


def test_the_tenant_is_named_by_x_api_key_or_a_bearer_token(tenants: InProcessDaemon, tmp_path: Path) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    url = base_url(tenants)
    with (
        anthropic.Anthropic(base_url=url, api_key="wrong-key-0123456789", max_retries=0) as nobody,
        pytest.raises(anthropic.AuthenticationError, match="not valid"),
    ):
        create(nobody, hi, max_tokens=1)
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": hi})
    assert r.status_code == 401 and r.json()["error"] == {
        "type": "authentication_error",
        "message": "an API key is required (x-api-key: KEY, or authorization: Bearer KEY)",
    }
    with anthropic.Anthropic(base_url=url, api_key=TOKENS["alice"], max_retries=0) as alice:
        assert create(alice, hi, max_tokens=1).usage.output_tokens == 1
    with anthropic.Anthropic(base_url=url, auth_token=TOKENS["bob"], max_retries=0) as bob:
        assert bob.messages.count_tokens(model=MODEL, messages=hi).input_tokens > 0  # type: ignore[arg-type]
    assert tenants.daemon is not None
    owners = {s.tenant for s in tenants.daemon.manager.sessions.values()}
    assert owners == {"alice"}
