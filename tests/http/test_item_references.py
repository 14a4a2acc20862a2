"""Input items that name a stored item (`{"type": "item_reference", "id": ...}`), as the
Vercel AI SDK's Responses provider sends its earlier turns' outputs: each is the output item
of the tenant's stored response it names.

What is checked, with OpenAI's own client on a daemon with two tenants: a referenced function
call and a referenced assistant message are the items they name (the reply is the one the
items given in full get at temperature 0, and the input items list them whole); an id that
names nothing, and another tenant's item, are 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from auth import TOKENS, write_auth
from daemons import InProcessDaemon, model_path

MODEL = model_path().stem
WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    root = tmp_path_factory.mktemp("references")
    d = InProcessDaemon.with_settings(
        root / "state", http_address="127.0.0.1:0", auth_file=write_auth(root / "auth.toml", TOKENS)
    )
    yield d
    d.stop()


@pytest.fixture
def alice(door: InProcessDaemon) -> Iterator[openai.OpenAI]:
    with client(door, "alice") as c:
        yield c


def client(door: InProcessDaemon, tenant: str) -> openai.OpenAI:
    assert door.daemon is not None
    url = f"http://127.0.0.1:{door.daemon.http_port}/v1"
    return openai.OpenAI(base_url=url, api_key=TOKENS[tenant], max_retries=0, timeout=120)


def create(c: openai.OpenAI, items: Any, **kw: Any) -> Any:
    options: dict[str, Any] = {"temperature": 0, "max_output_tokens": 24, **kw}
    return c.responses.create(model=MODEL, input=items, **options)


def test_a_referenced_function_call_is_the_stored_call(alice: openai.OpenAI) -> None:
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    called = create(
        alice, [ask], tools=WEATHER, tool_choice="required", max_output_tokens=60, parallel_tool_calls=False
    )
    [call] = called.output
    assert call.type == "function_call" and call.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 18}'}

    by_reference = create(alice, [ask, {"type": "item_reference", "id": call.id}, result], tools=WEATHER)
    in_full = create(alice, [ask, call.model_dump(exclude_none=True), result], tools=WEATHER)
    assert by_reference.output_text == in_full.output_text != ""
    listed = [
        i.model_dump(exclude_none=True)
        for i in alice.responses.input_items.list(by_reference.id, order="asc")
    ]
    assert listed[1] == call.model_dump(exclude_none=True)


def test_a_referenced_message_is_the_stored_message(alice: openai.OpenAI) -> None:
    first = {"role": "user", "content": "Name a city by the sea."}
    said = create(alice, [first])
    [message] = said.output
    assert message.type == "message" and said.output_text
    then = {"role": "user", "content": "Why that one?"}
    by_reference = create(alice, [first, {"type": "item_reference", "id": message.id}, then])
    in_full = create(alice, [first, {"role": "assistant", "content": said.output_text}, then])
    assert by_reference.output_text == in_full.output_text != ""
    assert by_reference.usage.input_tokens == in_full.usage.input_tokens


def test_an_item_that_is_not_the_tenants_is_404(door: InProcessDaemon, alice: openai.OpenAI) -> None:
    said = create(alice, "Name a colour.")
    mine = {"type": "item_reference", "id": said.output[0].id}
    with client(door, "bob") as bob:
        for ref in (mine, {"type": "item_reference", "id": "msg_unknown"}):
            with pytest.raises(openai.NotFoundError, match="no item"):
                create(bob, [{"role": "user", "content": "Hi"}, ref])
    # Deleted, the response's items are gone with it.
    alice.responses.delete(said.id)
    with pytest.raises(openai.NotFoundError, match="no item"):
        create(alice, [{"role": "user", "content": "Hi"}, mine])
    with pytest.raises(openai.BadRequestError, match="item_reference"):
        create(alice, [{"type": "item_reference"}])
