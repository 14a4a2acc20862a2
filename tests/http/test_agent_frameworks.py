"""pydantic-ai runs against the door as its users run it: an Agent on an OpenAI model (chat
completions and the Responses API) with a function tool and a typed answer, in each of its
output modes.

What is checked: every request the framework sends is served (200); the first offers the
function tool together with what the output mode asks for (a JSON-schema response format for
NativeOutput, an output tool with a call required for ToolOutput, a JSON-object response
format and the schema in the prompt for PromptedOutput); the run calls the tool, runs it, and
ends with a validated answer of the output type. Earlier turns (few-shot: the assistant calls,
then answers as the output mode has it) lead the 135M model to call first and to answer once
the result is back; the door's grammar holds each reply to its shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest
from daemons import InProcessDaemon, model_path
from pydantic import BaseModel
from pydantic_ai import Agent, NativeOutput, PromptedOutput, ToolOutput
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

MODEL = model_path().stem
CITIES = (("Rome", 25), ("Oslo", 3), ("Lima", 18))
SETTINGS = ModelSettings(temperature=0, max_tokens=60, parallel_tool_calls=False)


class Weather(BaseModel):
    """The weather of a city."""

    city: str
    celsius: int


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("agent-frameworks"), http_address="127.0.0.1:0")
    yield d
    d.stop()


class Wire:
    """What the framework sent and what the door answered, seen by the client's own transport."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.statuses: list[int] = []

    async def request(self, request: httpx2.Request) -> None:
        self.bodies.append(json.loads(request.content))

    async def response(self, response: httpx2.Response) -> None:
        self.statuses.append(response.status_code)


def provider(door: InProcessDaemon, wire: Wire) -> OpenAIProvider:
    assert door.daemon is not None
    hooks: dict[str, list[Callable[..., Any]]] = {"request": [wire.request], "response": [wire.response]}
    return OpenAIProvider(
        base_url=f"http://127.0.0.1:{door.daemon.http_port}/v1",
        api_key="unused",
        http_client=httpx2.AsyncClient(event_hooks=hooks, timeout=120),
    )


def few_shot(answer_by_tool: bool) -> list[ModelMessage]:
    """Earlier turns: a call of get_weather, its result, and the answer, as text or as a call of
    the output tool."""
    history: list[ModelMessage] = []
    for city, degrees in CITIES:
        call_id = f"call_{city}"
        answer = {"city": city, "celsius": degrees}
        history += [
            ModelRequest(parts=[UserPromptPart(f"What is the weather in {city}?")]),
            ModelResponse(parts=[ToolCallPart("get_weather", {"city": city}, call_id)]),
            ModelRequest(parts=[ToolReturnPart("get_weather", {"temperature": degrees}, call_id)]),
        ]
        if answer_by_tool:
            final_id = f"{call_id}_final"
            history += [
                ModelResponse(parts=[ToolCallPart("final_result", answer, final_id)]),
                ModelRequest(parts=[ToolReturnPart("final_result", "Final result processed.", final_id)]),
            ]
        else:
            history.append(ModelResponse(parts=[TextPart(json.dumps(answer))]))
    return history


def tools_offered(body: dict[str, Any]) -> list[str]:
    """The names of the tools a request offers, in the chat or the Responses shape."""
    return [t["function"]["name"] if "function" in t else t["name"] for t in body.get("tools", [])]


def run(
    door: InProcessDaemon, api: str, output: Any, answer_by_tool: bool
) -> tuple[Weather, Wire, list[str]]:
    """Run the agent once on the API's model; its answer, the wire, and the tool's calls."""
    wire = Wire()
    kind = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(
        kind(MODEL, provider=provider(door, wire)),
        output_type=output,
        instructions="You are a helpful assistant.",
        model_settings=SETTINGS,
    )
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> dict[str, int]:
        """The weather of a place."""
        calls.append(city)
        return {"temperature": 21}

    result = agent.run_sync("What is the weather in Paris?", message_history=few_shot(answer_by_tool))
    assert isinstance(result.output, Weather)
    assert wire.statuses and all(s == 200 for s in wire.statuses), wire.statuses
    assert "get_weather" in tools_offered(wire.bodies[0])
    return result.output, wire, calls


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_native_output_with_a_tool(door: InProcessDaemon, api: str) -> None:
    # The answer's JSON schema as the response format, together with the tools.
    answer, wire, calls = run(door, api, NativeOutput(Weather), answer_by_tool=False)
    first = wire.bodies[0]
    fmt = first["response_format"]["json_schema"] if api == "chat" else first["text"]["format"]
    assert fmt["schema"]["required"] == ["city", "celsius"]
    assert calls == ["Paris"] and len(wire.bodies) == 2
    assert answer.city


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_tool_output_with_a_tool(door: InProcessDaemon, api: str) -> None:
    # The answer is a call of an output tool; a reply must call one of the tools.
    answer, wire, calls = run(door, api, ToolOutput(Weather), answer_by_tool=True)
    first = wire.bodies[0]
    assert first["tool_choice"] == "required" and "final_result" in tools_offered(first)
    assert calls == ["Paris"] and len(wire.bodies) == 2
    assert answer.city


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_prompted_output_with_a_tool(door: InProcessDaemon, api: str) -> None:
    # The schema is in the prompt and the reply held to a JSON object.
    answer, wire, calls = run(door, api, PromptedOutput(Weather), answer_by_tool=False)
    first = wire.bodies[0]
    fmt = first["response_format"] if api == "chat" else first["text"]["format"]
    assert fmt["type"] == "json_object"
    assert calls == ["Paris"]
    assert answer.city
