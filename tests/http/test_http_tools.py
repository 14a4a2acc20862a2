"""Tool calls and structured output through the HTTP door, with OpenAI's own client.

What is checked: calls come back in OpenAI's message shape (`tool_calls`, content null,
finish reason `tool_calls`) and validate against their schemas; streamed, they come as
OpenAI's deltas (index, id, type and name first, then the arguments in pieces) that OpenAI's
stream helper joins into the same completion; a named function, one call at most, several
calls; a conversation replayed with its calls and results (ids of another server's) is
continued, the kept session evaluating only what is new; llama.cpp's `grammar`, top-level
`json_schema` and `response_format` with a `schema` hold the output; what cannot be honoured
gets a 400 whose body names the field (`param`) and a specific `code`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
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
    {"type": "function", "function": {"name": n, "description": f"{n} of a place.", "parameters": p}}
    for n, p in SCHEMAS.items()
]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("http-tools"), http_address="127.0.0.1:0")
    yield d
    d.stop()


@pytest.fixture
def oai(door: InProcessDaemon) -> Iterator[openai.OpenAI]:
    assert door.daemon is not None
    url = f"http://127.0.0.1:{door.daemon.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def create(oai: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=messages, **kw)  # type: ignore[arg-type]


def valid(calls: Any) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def few_shot() -> list[dict[str, Any]]:
    """Earlier turns in which the assistant called get_weather: the 135M model follows them."""
    out: list[dict[str, Any]] = [SYSTEM]
    for city, degrees in (("Rome", 25), ("Oslo", 3), ("Lima", 18)):
        call = {
            "id": f"call_{city}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})},
        }
        out += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": degrees})},
            {"role": "assistant", "content": f"It is {degrees} degrees in {city}."},
        ]
    return out


def test_required_calls_in_openai_s_shape_streamed_as_its_deltas(oai: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Weather in Oslo, and the time in Tokyo?"}]
    # Room for the calls to end: OpenAI's stream helper refuses a reply cut at max_tokens.
    most = 240
    options: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "seed": 7, "temperature": 0.9}
    whole = create(oai, messages, max_tokens=most, **options)
    choice = whole.choices[0]
    assert choice.message.content is None and choice.message.tool_calls
    complete = (
        choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
    )
    valid(complete)
    one = create(oai, messages, max_tokens=most, parallel_tool_calls=False, **options)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    valid(one.choices[0].message.tool_calls)

    # Streamed: OpenAI's own stream helper checks the deltas' shape and joins them.
    with oai.chat.completions.stream(model=MODEL, messages=messages, max_tokens=most, **options) as stream:  # type: ignore[arg-type]
        firsts, pieces = {}, 0
        for event in stream:
            if event.type == "chunk":
                for d in event.chunk.choices[0].delta.tool_calls or ():
                    if d.id is not None:
                        assert d.index not in firsts and d.type == "function" and d.function.name
                        assert d.function.arguments == ""
                        firsts[d.index] = d.id
                    else:
                        assert d.index in firsts and d.function.arguments
                        pieces += 1
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == choice.finish_reason

    def calls(message: Any) -> list[tuple[str, str, str]]:
        return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]

    assert calls(streamed.choices[0].message) == calls(choice.message)
    assert pieces >= 2 * len(firsts)


def test_a_named_function(oai: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = create(
        oai,
        [SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice=named,
        max_tokens=60,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_time"]
    valid(reply.choices[0].message.tool_calls)


def test_auto_calls_and_a_result_fed_back_is_answered_by_the_kept_session(oai: openai.OpenAI) -> None:
    messages = [*few_shot(), {"role": "user", "content": "What is the weather in Paris?"}]
    first = create(oai, messages, tools=TOOLS[:1], temperature=0, max_tokens=80)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    valid([call])
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    answer = create(oai, messages, tools=TOOLS[:1], temperature=0, max_tokens=24)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # The door's kept session continues: only the result (and the reply) are new.
    usage = answer.usage
    assert (
        usage.prompt_tokens_details.cached_tokens
        >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    )


def test_structured_output_fields_of_llama_cpp(oai: openai.OpenAI) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Give me a city."}]
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    }
    for extra in ({"json_schema": schema}, {"response_format": {"type": "json_object", "schema": schema}}):
        reply = create(oai, messages, temperature=0, max_tokens=40, extra_body=extra)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    digits = create(
        oai, messages, temperature=0, max_tokens=8, extra_body={"grammar": 'root ::= [0-9]{3} "!"'}
    )
    assert re.fullmatch(r"[0-9]{3}!", digits.choices[0].message.content)
    raw = oai.completions.create(
        model=MODEL, prompt="Count:", max_tokens=8, extra_body={"grammar": "root ::= [0-9]{2}"}
    )
    assert re.fullmatch(r"[0-9]{2}", raw.choices[0].text)


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"grammar": "root ::= missing"}, "grammar", "invalid_value"),
    ({"json_schema": {"type": "strang"}}, "json_schema", "invalid_value"),
    ({"response_format": {"type": "json_object", "schema": 5}}, "response_format", "invalid_value"),
    ({"json_schema": {}, "response_format": {"type": "json_object"}}, "json_schema", "invalid_value"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"a": {"type": "strang"}}}},
                }
            ],
            "tool_choice": "required",
        },
        "tools",
        "invalid_value",
    ),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "invalid_value"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "invalid_value",
    ),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"functions": [{"name": "f"}]}, "functions", "invalid_value"),
    ({"mirostat": 2}, "mirostat", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "invalid_value"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                    ],
                }
            ]
        },
        "messages",
        "invalid_value",
    ),
    ({"max_tokens": 100000}, "messages", "context_length_exceeded"),
    ({"messages": None}, "messages", "invalid_value"),
    ({"model": None}, "model", "invalid_value"),
]


@pytest.mark.parametrize("change,param,code", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    door: InProcessDaemon, change: dict[str, Any], param: str, code: str
) -> None:
    assert door.daemon is not None
    body = {
        "model": MODEL,
        "messages": [SYSTEM, {"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        **change,
    }
    r = httpx.post(f"http://127.0.0.1:{door.daemon.http_port}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["message"] and error["type"] == "invalid_request_error"
