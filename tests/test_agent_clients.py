"""What agent clients and frameworks send, served as they send it: on one daemon with both
doors, through OpenAI's own client, kvkeep's SDK, and the frameworks themselves (LangChain's
`create_agent`).

What is checked: ChatKvkeep honours a bound `response_format` (LangChain's ProviderStrategy)
and refuses a keyword it does not know, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from daemons import InProcessDaemon
from langchain.agents import create_agent
from langchain.agents.structured_output import ProviderStrategy
from pydantic import BaseModel, Field

from kvkeep.integrations.langchain import ChatKvkeep


class Weather(BaseModel):
    """The weather of a city."""

    city: str = Field(max_length=16)
    celsius: int = Field(ge=-50, le=50)


WEATHER_SCHEMA: dict[str, Any] = Weather.model_json_schema()


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("agents"), http_address="127.0.0.1:0")
    yield d
    d.stop()


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
