"""What agent clients and frameworks send, served as they send it: on one daemon with both
doors, through OpenAI's own client, kvkeep's SDK, and the frameworks themselves (LangChain's
`create_agent`).

What is checked: ChatKvkeep honours a bound `response_format` (LangChain's ProviderStrategy)
and refuses a keyword it does not know, naming it. Tools together with a JSON-schema response
format (an agent with tools and a typed answer) on every door: chat completions, Responses,
gRPC through the SDK, the CLI and ChatKvkeep under LangChain's `create_agent`: a reply is
calls held to their tools' schemas or an answer held to the response schema, in one turn's
grammar; the conversation (few-shot turns in which the assistant calls, then answers in
JSON) leads the 135M model to call first, then to answer once the result is back. A call cut
short by `max_tokens` (arguments that are not JSON), sent back with an error result as agents
do, is accepted and rendered as the model wrote it: the kept session evaluates only what
follows it, on the default model (the generic format writes arguments as text) and on a
hermes-format model whose template writes them with `tojson`. A stored response continued
with no input (to ask for a typed final answer) is one more reply after it, its state kept.
Codex CLI's first request, in the shape its source builds (function tools, a namespace group,
a hosted tool, reasoning, include, client_metadata, store off), is served: no reasoning items,
the hosted tool left out and named in a header and the access log, the namespace's function
called with its name and namespace. Errors name the Responses API's fields, the access log
gives a refusal's reason code, temperatures outside 0-2 are refused, and system_fingerprint
names the model file, the llama.cpp build and the mode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import toolmodels
from accesslog import await_lines
from checkpoint_helpers import own_daemon
from click.testing import CliRunner
from daemons import InProcessDaemon, model_path
from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

import kvkeep
from kvkeep.cli import main
from kvkeep.integrations.langchain import ChatKvkeep

MODEL = model_path().stem


class Weather(BaseModel):
    """The weather of a city."""

    city: str = Field(max_length=16)
    celsius: int = Field(ge=-50, le=50)


WEATHER_SCHEMA: dict[str, Any] = Weather.model_json_schema()
# The tool's parameters, and the typed answer's schema (the response format).
LOOKUP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "celsius": {"type": "integer"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
DESCRIPTION = "The weather of a place."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": LOOKUP_SCHEMA},
    }
]
FORMAT: dict[str, Any] = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER_SCHEMA}}
SYSTEM = "You are a helpful assistant."
CITIES = (("Rome", 25), ("Oslo", 3), ("Lima", 18))


def few_shot() -> list[dict[str, Any]]:
    """Earlier turns in OpenAI's chat shape: the assistant calls get_weather, then answers in
    the response format's JSON."""
    out: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for city, degrees in CITIES:
        arguments = json.dumps({"city": city, "unit": "celsius"})
        call = {
            "id": f"call_{city}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
        out += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": degrees})},
            {"role": "assistant", "content": json.dumps({"city": city, "celsius": degrees})},
        ]
    return out


def call_is_valid(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), LOOKUP_SCHEMA)


def answer_is_valid(text: str | None) -> None:
    assert text is not None
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("agents"), http_address="127.0.0.1:0")
    yield d
    d.stop()


def url(door: InProcessDaemon) -> str:
    assert door.daemon is not None
    return f"http://127.0.0.1:{door.daemon.http_port}/v1"


@pytest.fixture
def oai(door: InProcessDaemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url(door), api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(door: InProcessDaemon, **kw: Any) -> ChatKvkeep:
    return ChatKvkeep(address=door.address, **{"temperature": 0, "max_tokens": 60, **kw})


def test_chat_kvkeep_honours_a_bound_response_format(door: InProcessDaemon) -> None:
    # LangChain's agent with a ProviderStrategy binds OpenAI's response_format and parses the
    # reply's text as JSON: free text was a StructuredOutputValidationError.
    agent = create_agent(model=chat(door), tools=[], response_format=ProviderStrategy(Weather))
    out = agent.invoke({"messages": [{"role": "user", "content": "Weather in Paris?"}]})
    assert isinstance(out["structured_response"], Weather)

    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA}}
    reply = chat(door).invoke("Weather in Rome?", response_format=fmt)
    jsonschema.validate(json.loads(str(reply.content)), WEATHER_SCHEMA)
    obj = chat(door).invoke("Weather in Oslo?", response_format={"type": "json_object"})
    assert isinstance(json.loads(str(obj.content)), dict)
    with pytest.raises(ValueError, match="response_format must be"):
        chat(door).invoke("Hi", response_format={"type": "yaml"})


def test_chat_kvkeep_refuses_a_keyword_it_does_not_know(door: InProcessDaemon) -> None:
    with pytest.raises(TypeError, match="'reasoning_effort'"):
        chat(door).invoke("Hi", reasoning_effort="high")
    with pytest.raises(TypeError, match="'frequency_penalty'"):
        chat(door).bind(frequency_penalty=0.5).invoke("Hi")
    # A per-call model is the name the reply reports (the daemon serves one model).
    assert chat(door).invoke("Hi", model="other-name").response_metadata["model_name"] == "other-name"


def test_tools_with_a_response_schema_on_chat_completions(oai: openai.OpenAI) -> None:
    messages = [*few_shot(), {"role": "user", "content": "What is the weather in Paris?"}]
    options: dict[str, Any] = {"tools": TOOLS, "response_format": FORMAT, "temperature": 0, "max_tokens": 80}
    first = oai.chat.completions.create(model=MODEL, messages=messages, **options)
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    (call,) = first.choices[0].message.tool_calls or []
    assert call.type == "function"
    call_is_valid(call.function.name, call.function.arguments)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    answer = oai.chat.completions.create(model=MODEL, messages=messages, **options)
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    answer_is_valid(answer.choices[0].message.content)
    # Streamed, the answer is the same.
    with oai.chat.completions.stream(model=MODEL, messages=messages, **options) as stream:
        streamed = stream.get_final_completion()
    assert streamed.choices[0].message.content == answer.choices[0].message.content


def test_tools_with_a_response_schema_on_responses(oai: openai.OpenAI) -> None:
    items: list[dict[str, Any]] = []
    for m in few_shot()[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            f = m["tool_calls"][0]
            items.append({"type": "function_call", "call_id": f["id"], **f["function"]})
        elif m["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
            )
        else:
            items.append({"role": m["role"], "content": m["content"]})
    items.append({"role": "user", "content": "What is the weather in Paris?"})
    tools = [
        {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": LOOKUP_SCHEMA}
    ]
    text = {"format": {"type": "json_schema", "name": "weather", "schema": ANSWER_SCHEMA}}
    options: dict[str, Any] = {"tools": tools, "text": text, "temperature": 0, "max_output_tokens": 80}
    first = oai.responses.create(model=MODEL, instructions=SYSTEM, input=items, **options)  # type: ignore[arg-type]
    (call,) = [o for o in first.output if o.type == "function_call"]
    call_is_valid(call.name, call.arguments)
    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": json.dumps({"temperature": 21}),
    }
    answer = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        **options,  # type: ignore[arg-type]
    )
    assert [o.type for o in answer.output] == ["message"]
    answer_is_valid(answer.output_text)


def sdk_messages() -> list[kvkeep.Message]:
    out = []
    for m in few_shot()[1:]:
        calls = tuple(
            kvkeep.ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in m.get("tool_calls") or ()
        )
        out.append(kvkeep.Message(m["role"], m["content"] or "", calls, m.get("tool_call_id")))
    return out


def test_tools_with_a_response_schema_over_grpc_and_the_cli(door: InProcessDaemon, tmp_path: Path) -> None:
    tools = [kvkeep.Tool("get_weather", DESCRIPTION, LOOKUP_SCHEMA)]
    options: dict[str, Any] = {"tools": tools, "json_schema": ANSWER_SCHEMA, "max_tokens": 80}
    with kvkeep.Client(door.address, timeout=60) as client:
        session = client.create_session(SYSTEM, sampling=kvkeep.SamplingParams(temperature=0))
        ask = [*sdk_messages(), kvkeep.Message("user", "What is the weather in Paris?")]
        first = session.chat(ask, **options)
        (call,) = first.tool_calls
        call_is_valid(call.name, call.arguments)
        answer = session.chat(
            [kvkeep.Message("tool", '{"temperature": 21}', tool_call_id=call.call_id)], **options
        )
        assert not answer.tool_calls
        answer_is_valid(answer.text)
        session.close()

    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "answer.json").write_text(json.dumps(ANSWER_SCHEMA))
    result = CliRunner().invoke(
        main,
        [
            "--address",
            door.address,
            "run",
            "--system",
            SYSTEM,
            "--temperature",
            "0",
            "--max-tokens",
            "60",
            "--tools",
            str(tmp_path / "tools.json"),
            "--json-schema",
            str(tmp_path / "answer.json"),
            "Give me a city and its temperature.",
        ],
    )
    assert result.exit_code == 0, result.output
    answer_is_valid(result.stdout)


def test_tools_with_a_response_schema_in_a_langchain_agent(door: InProcessDaemon) -> None:
    looked_up: list[str] = []

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather of a place."""
        looked_up.append(city)
        return json.dumps({"temperature": 21})

    history: list[BaseMessage] = [SystemMessage(SYSTEM)]
    for city, degrees in CITIES:
        call = {"name": "get_weather", "args": {"city": city, "unit": "celsius"}, "id": f"call_{city}"}
        history += [
            HumanMessage(f"What is the weather in {city}?"),
            AIMessage("", tool_calls=[call]),
            ToolMessage(json.dumps({"temperature": degrees}), tool_call_id=call["id"]),
            AIMessage(json.dumps({"city": city, "celsius": degrees})),
        ]
    history.append(HumanMessage("What is the weather in Paris?"))

    class Answer(BaseModel):
        city: str = Field(max_length=16)
        celsius: int

    agent = create_agent(
        model=chat(door, max_tokens=80), tools=[get_weather], response_format=ProviderStrategy(Answer)
    )
    out = agent.invoke({"messages": history})
    assert looked_up == ["Paris"]
    assert isinstance(out["structured_response"], Answer)


def test_a_grammar_with_tools_is_refused_naming_the_grammar(door: InProcessDaemon) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": TOOLS,
        "grammar": 'root ::= "yes"',
        "max_tokens": 4,
    }
    r = httpx.post(url(door) + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text


def cut_call_sent_back(base_url: str, model: str, messages: list[dict[str, Any]]) -> None:
    """A required call cut short in its arguments, then the conversation sent back with the
    call as it is and an error result: accepted, the call rendered as the model wrote it (so
    the kept session evaluates only the result and what follows)."""
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as oai:
        options: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        options["temperature"] = 0
        whole = oai.chat.completions.create(model=model, messages=messages, max_tokens=80, **options)
        assert whole.usage is not None
        # The same reply cut a few tokens before the call's end: inside its arguments.
        cut = whole.usage.completion_tokens - 10
        first = oai.chat.completions.create(model=model, messages=messages, max_tokens=cut, **options)
        assert first.choices[0].finish_reason == "length"
        (call,) = first.choices[0].message.tool_calls or []
        assert call.function.arguments.startswith("{")
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)
        error = "error: the arguments were cut short; call again"
        again = [
            *messages,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": error},
        ]
        options["tool_choice"] = "auto"
        retry = oai.chat.completions.create(model=model, messages=again, max_tokens=4, **options)
        assert retry.usage is not None and first.usage is not None
        cached = retry.usage.prompt_tokens_details
        assert cached is not None
        assert cached.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1


def test_a_call_cut_short_is_sent_back_as_it_was_written(
    door: InProcessDaemon, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ask = [*few_shot(), {"role": "user", "content": "What is the weather in Paris?"}]
    cut_call_sent_back(url(door), MODEL, ask)
    path = toolmodels.path("hermes")
    state = tmp_path_factory.mktemp("hermes")
    with own_daemon(state, model=path, slots=2, http_address="127.0.0.1:0") as hermes:
        cut_call_sent_back(url(hermes), path.stem, [{"role": "user", "content": "Weather in Paris?"}])


def codex_first_request(prompt: str) -> dict[str, Any]:
    """The body of Codex CLI's first request (its Responses request struct, codex-rs
    codex-api/src/common.rs, and its tool specs, codex-rs/tools/src/tool_spec.rs): function
    tools, a namespace group of function tools (an MCP server's), a hosted tool, reasoning
    with a summary, the encrypted reasoning asked back, store off, a prompt cache key and the
    client's metadata."""
    shell = {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
        "additionalProperties": False,
    }
    read = {
        "type": "object",
        "properties": {"path": {"type": "string"}},
        "required": ["path"],
        "additionalProperties": False,
    }
    return {
        "model": MODEL,
        "instructions": "You are a coding agent running in a terminal.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "cwd: /src"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]},
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "Runs a command.",
                "strict": False,
                "parameters": shell,
            },
            {
                "type": "namespace",
                "name": "mcp__files",
                "description": "Tools of the files MCP server.",
                "tools": [
                    {
                        "type": "function",
                        "name": "read",
                        "description": "Reads a file.",
                        "strict": False,
                        "parameters": read,
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7e2-codex-session",
        "text": {"verbosity": "medium"},
        "client_metadata": {"x-codex-turn": "1"},
    }


def test_codex_s_first_request_is_served(
    oai: openai.OpenAI, door: InProcessDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    body = codex_first_request("Say hello.")
    # OpenAI's client has no client_metadata parameter: it goes in the body as Codex sends it.
    extra = {"client_metadata": body.pop("client_metadata")}
    with caplog.at_level(logging.INFO, logger="kvkeepd.access"):
        raw = oai.responses.with_raw_response.create(**body, extra_body=extra)
        events = list(raw.parse())
        lines = await_lines(caplog, lambda ls: any("ignored-tools=web_search" in line for line in ls))
    # The hosted tool the daemon cannot run is left out of what the model sees, and said so.
    assert raw.headers["x-kvkeep-ignored-tools"] == "web_search"
    assert any("ignored-tools=web_search" in line for line in lines), lines
    done = events[-1]
    assert done.type in ("response.completed", "response.incomplete")
    # No reasoning items from a model that does not reason apart from its reply.
    assert all(item.type != "reasoning" for item in done.response.output)

    # The namespace's function, the only one left to call, is called as OpenAI names it.
    body = codex_first_request("Read README.md.")
    body["tools"] = body["tools"][1:2]
    body.update(stream=False, tool_choice="required", max_output_tokens=60)
    body.pop("client_metadata")
    first = oai.responses.create(**body)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert (call.name, call.model_extra) == ("read", {"namespace": "mcp__files"}) or (
        call.name == "read" and getattr(call, "namespace", None) == "mcp__files"
    )
    # Codex sends the whole input back, the call with its namespace and its output after it.
    body["input"] = [
        *body["input"],
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": "read",
            "namespace": "mcp__files",
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "# kvkeep"},
    ]
    body.update(tool_choice="auto", max_output_tokens=8)
    assert oai.responses.create(**body).status in ("completed", "incomplete")


def post(door: InProcessDaemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url(door) + path, json=body, timeout=60)


def test_errors_name_the_field_and_the_access_log_its_reason(
    door: InProcessDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    responses = {"model": MODEL, "input": "Hi", "max_output_tokens": 16}
    cases: list[tuple[str, dict[str, Any], str]] = [
        # OpenAI's range of temperatures is 0 to 2.
        ("/chat/completions", {**chat, "temperature": 3}, "temperature"),
        ("/responses", {**responses, "temperature": 3}, "temperature"),
        # A schema that does not compile is blamed on the field it came in.
        ("/responses", {**responses, "input": [{"role": "tool", "content": "x"}]}, "input"),
        ("/responses", {**responses, "max_output_tokens": 100000}, "input"),
    ]
    with caplog.at_level(logging.INFO, logger="kvkeepd.access"):
        for path, body, param in cases:
            r = post(door, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
        lines = await_lines(caplog, lambda ls: len(ls) >= len(cases))
    assert len(lines) >= len(cases)
    assert all(
        line.endswith(" 400 invalid_value") or line.endswith(" 400 context_length_exceeded")
        for line in lines[-len(cases) :]
    ), lines


def test_system_fingerprint_names_the_model_build_and_mode(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    fingerprint = reply.system_fingerprint or ""
    assert MODEL in fingerprint and "llama.cpp" in fingerprint
    assert fingerprint.endswith(("exact", "compact"))


def test_a_response_continued_with_no_input(oai: openai.OpenAI) -> None:
    # A typed final answer asked of a stored response, with nothing new in the input.
    first = oai.responses.create(model=MODEL, input="Name a city.", max_output_tokens=8, temperature=0)
    text = {"format": {"type": "json_schema", "name": "weather", "schema": ANSWER_SCHEMA}}
    for more in ({"input": []}, {}):
        typed = oai.responses.create(
            model=MODEL, previous_response_id=first.id, text=text, max_output_tokens=40, temperature=0, **more
        )
        answer_is_valid(typed.output_text)
        # Only the new turn's opening was evaluated: the stored response's state was kept.
        assert typed.usage is not None and first.usage is not None
        assert typed.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1
    with pytest.raises(openai.BadRequestError, match="input"):
        oai.responses.create(model=MODEL, input=[], max_output_tokens=4)


def test_chat_fields_that_cannot_change_the_reply_are_accepted_and_those_that_would_refused(
    door: InProcessDaemon,
) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    accepted = {
        "reasoning_effort": "high",
        "prediction": {"type": "content", "content": "Hello"},
        "store": True,
        "metadata": {"k": "v"},
        "prompt_cache_key": "agent-1",
        "modalities": ["text"],
        "verbosity": "medium",
    }
    plain = post(door, "/chat/completions", chat)
    given = post(door, "/chat/completions", {**chat, **accepted})
    assert given.status_code == 200, given.text
    assert given.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    for field, value in (
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("verbosity", "low"),
        ("web_search_options", {}),
    ):
        r = post(door, "/chat/completions", {**chat, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
