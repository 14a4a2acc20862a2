"""The OpenAI Agents SDK (`openai-agents`) runs against the door as its users run it: an Agent
with a function tool and a typed answer (`output_type`) on the Responses API.

What is checked: the SDK's first request (tools together with the answer's JSON schema) and
its next (the tool's result sent back) are served; the run calls the tool with arguments its
schema allows, runs it, and ends with a final output that is the answer type. Earlier turns
(few-shot: the assistant calls, then answers in JSON) lead the 135M model to call first and
to answer once the result is back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from daemons import InProcessDaemon, model_path
from pydantic import BaseModel

MODEL = model_path().stem
CITIES = (("Rome", 25), ("Oslo", 3), ("Lima", 18))


class Weather(BaseModel):
    """The weather of a city."""

    city: str
    celsius: int


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("openai-agents"), http_address="127.0.0.1:0")
    yield d
    d.stop()


def few_shot() -> list[dict[str, Any]]:
    """Earlier turns as Responses input items: a call of get_weather, its result, the answer."""
    items: list[dict[str, Any]] = []
    for city, degrees in CITIES:
        call_id = f"call_{city}"
        items += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "type": "function_call",
                "call_id": call_id,
                "name": "get_weather",
                "arguments": json.dumps({"city": city, "unit": "celsius"}),
            },
            {
                "type": "function_call_output",
                "call_id": call_id,
                "output": json.dumps({"temperature": degrees}),
            },
            {"role": "assistant", "content": json.dumps({"city": city, "celsius": degrees})},
        ]
    return items


def test_an_agent_with_a_tool_and_an_output_type_runs_to_its_typed_answer(door: InProcessDaemon) -> None:
    assert door.daemon is not None
    set_tracing_disabled(True)  # nothing is sent to OpenAI's tracing service
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather of a place."""
        calls.append((city, unit))
        return json.dumps({"temperature": 21})

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{door.daemon.http_port}/v1", api_key="unused", max_retries=0, timeout=120
    )
    agent = Agent(
        name="weather",
        instructions="You are a helpful assistant.",
        tools=[get_weather],
        output_type=Weather,
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=80),
    )
    ask = [*few_shot(), {"role": "user", "content": "What is the weather in Paris?"}]
    result = Runner.run_sync(agent, ask, max_turns=3)  # type: ignore[arg-type]
    assert len(calls) == 1 and calls[0][0]
    assert isinstance(result.final_output, Weather)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
