"""OpenAI's Responses API on the HTTP door, through OpenAI's own client (sync and async).

- Text in, text out, streamed and not (the same reply), the `responses.stream` helper and
  `output_text`; structured output by `text.format`; the stream's events in OpenAI's order
  with their sequence numbers, and a stored response's stream replayed.
- `previous_response_id` continues the response's session in place (nothing evaluated again:
  `cached_tokens`), and any older response forks from its checkpoint, exactly: a branch
  gives what the in-place continuation gave; the resumes metric counts where each came from.
- `store: false` leaves nothing behind, and a session continued without storing goes back to
  its response; deleting a response deletes what only it referenced; another tenant's id
  is an unknown one; fields kvkeep cannot honour are 400.
- A stored response survives `kill -9` and continues bit-exactly with the same sampler;
  responses expire by `--response-ttl`; daemons sharing a catalog and store continue each
  other's responses.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from auth import TOKENS, write_auth
from daemons import DaemonProcess, InProcessDaemon, model_path, wait_until
from servers import free_port

import kvkeep
from kvkeepd.sessions.flows.responses import checkpoint_of

MODEL = model_path().stem
INSTRUCTIONS = (
    "You are the archivist of a harbour town. You answer in one short sentence and never "
    "invent facts. The town keeps ledgers of ships, tides, storms and cargo."
)


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon.with_settings(tmp_path_factory.mktemp("responses"), http_address="127.0.0.1:0")
    yield d
    d.stop()


def base_url(d: InProcessDaemon) -> str:
    assert d.daemon is not None
    return f"http://127.0.0.1:{d.daemon.http_port}/v1"


@pytest.fixture
def oai(door: InProcessDaemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url(door), api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def create(oai: openai.OpenAI, input_text: str | list[dict[str, Any]], **kw: Any) -> Any:
    args = {"model": MODEL, "instructions": INSTRUCTIONS, "max_output_tokens": 12, "temperature": 0, **kw}
    return oai.responses.create(input=input_text, **args)


def resumes(d: InProcessDaemon) -> dict[str, int]:
    assert d.daemon is not None
    return dict(d.daemon.manager.publish().response_resumes)


def stored_responses(d: InProcessDaemon) -> int:
    assert d.daemon is not None
    catalog = d.daemon.manager.stores.durable.catalog
    return len(catalog.old_responses(float("inf"), 1 << 20))


def test_a_response_in_text_streamed_and_not(oai: openai.OpenAI) -> None:
    # Room for the whole reply: OpenAI's client gives a stream's final response only when it
    # completed, not when the reply was cut at max_output_tokens.
    whole = create(oai, "Name three colours.", max_output_tokens=64)
    assert whole.object == "response" and whole.model == MODEL and whole.id.startswith("resp_")
    assert whole.status == "completed" and whole.output_text
    assert whole.instructions == INSTRUCTIONS and whole.store is True
    u = whole.usage
    assert u.output_tokens <= 64 and u.total_tokens == u.input_tokens + u.output_tokens
    args = {"model": MODEL, "instructions": INSTRUCTIONS, "max_output_tokens": 64, "temperature": 0}
    with oai.responses.stream(input="Name three colours.", **args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    # The stored response is the one the stream ended with, and its stream replays.
    assert oai.responses.retrieve(final.id).output_text == whole.output_text
    replayed = list(oai.responses.retrieve(final.id, stream=True))
    assert [e.type for e in replayed][:2] == ["response.created", "response.in_progress"]
    assert "".join(e.delta for e in replayed if e.type == "response.output_text.delta") == whole.output_text
    later = list(oai.responses.retrieve(final.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in later] == [e.sequence_number for e in replayed][4:]


def test_previous_response_id_continues_in_place_and_a_branch_forks_exactly(
    oai: openai.OpenAI, door: InProcessDaemon
) -> None:
    first = create(oai, "Which ship came in today?", temperature=0.9)
    before = resumes(door)
    second = create(oai, "And yesterday?", previous_response_id=first.id, temperature=0.9)
    # In place: the whole conversation is the input, and all of it but the new turn is cached.
    assert second.usage.input_tokens > first.usage.total_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.total_tokens - 1
    # An older response forks from its checkpoint: the same reply, drawn the same way.
    branch = create(oai, "And yesterday?", previous_response_id=first.id, temperature=0.9)
    assert branch.output_text == second.output_text
    assert branch.usage.input_tokens_details.cached_tokens == second.usage.input_tokens_details.cached_tokens
    after = resumes(door)
    assert after.get("slot", 0) - before.get("slot", 0) == 1
    assert after.get("ram", 0) - before.get("ram", 0) == 1
    # Input items list what each request gave, newest first by default.
    create(oai, "And the day before?", previous_response_id=second.id)
    items = oai.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And yesterday?"]


def test_a_chain_keeps_two_whole_states_and_an_older_branch_loads_its_blocks_exactly(
    oai: openai.OpenAI, door: InProcessDaemon
) -> None:
    """A chain continued in place keeps in RAM the whole states of its newest two responses
    (a branch from the one before the newest, a retry, loads as it is); an older response's
    gives way, and a branch from it reads its blocks and continues exactly as well."""
    assert door.daemon is not None
    wholes = door.daemon.manager.residency.wholes
    first = create(oai, "Which ship came in today?", temperature=0.9)
    second = create(oai, "And yesterday?", previous_response_id=first.id, temperature=0.9)
    third = create(oai, "And the day before?", previous_response_id=second.id, temperature=0.9)
    held = {r.id: checkpoint_of(r.id) in wholes for r in (first, second, third)}
    assert held == {first.id: False, second.id: True, third.id: True}
    before = resumes(door)
    retry = create(oai, "And the day before?", previous_response_id=second.id, temperature=0.9)
    branch = create(oai, "And yesterday?", previous_response_id=first.id, temperature=0.9)
    assert (retry.output_text, branch.output_text) == (third.output_text, second.output_text)
    after = resumes(door)
    assert after.get("ram", 0) - before.get("ram", 0) == 1
    assert after.get("disk", 0) - before.get("disk", 0) == 1


def test_store_false_leaves_nothing_and_puts_the_session_back(
    oai: openai.OpenAI, door: InProcessDaemon
) -> None:
    base = create(oai, "Who keeps the lighthouse?", temperature=0.9)
    n = stored_responses(door)
    aside = create(oai, "Tell me a secret.", previous_response_id=base.id, store=False, temperature=0.9)
    assert stored_responses(door) == n
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(aside.id)
    # The session went back to `base`: continuing it now is the same as the aside was.
    again = create(oai, "Tell me a secret.", previous_response_id=base.id, temperature=0.9)
    assert again.output_text == aside.output_text
    assert resumes(door).get("slot", 0) >= 2
    fresh = create(oai, "Hello.", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(fresh.id)


def test_a_client_that_leaves_a_stream_leaves_the_response_as_it_was(
    oai: openai.OpenAI, door: InProcessDaemon
) -> None:
    base = create(oai, "Name the piers.", temperature=0.9)
    expected = create(oai, "Count to fifty.", previous_response_id=base.id, store=False, temperature=0.9)
    args = {"model": MODEL, "instructions": INSTRUCTIONS, "temperature": 0.9, "max_output_tokens": 200}
    stream = oai.responses.create(input="Count to fifty.", previous_response_id=base.id, stream=True, **args)
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()
    assert door.daemon is not None
    door.run(door.daemon.manager.settle(), timeout=60)
    before = resumes(door).get("slot", 0)
    again = create(oai, "Count to fifty.", previous_response_id=base.id, store=False, temperature=0.9)
    assert again.output_text == expected.output_text
    assert resumes(door).get("slot", 0) == before + 1  # in place: the session was cut back


def test_delete_takes_what_only_the_response_referenced(oai: openai.OpenAI, door: InProcessDaemon) -> None:
    assert door.daemon is not None
    durable = door.daemon.manager.stores.durable
    first = create(oai, "List the piers.", max_output_tokens=40)
    second = create(oai, "And the tides?", previous_response_id=first.id, max_output_tokens=40)
    blocks = len(durable.catalog.known_blocks())
    oai.responses.delete(second.id)
    # Its own blocks went (the first response's are still referenced by it).
    assert len(durable.catalog.known_blocks()) < blocks
    for call in (
        lambda: oai.responses.retrieve(second.id),
        lambda: oai.responses.delete(second.id),
        lambda: oai.responses.input_items.list(second.id),
        lambda: create(oai, "More.", previous_response_id=second.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert create(oai, "More.", previous_response_id=first.id).output_text


def test_structured_output_by_text_format(oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    r = create(oai, "Describe a sailor as JSON.", text=fmt, max_output_tokens=60)
    assert r.status == "completed"
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert r.text.format.type == "json_schema"
    obj = create(
        oai, "Describe a ship as JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=40
    )
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("background", True, "background"),
        ("tools", [{"type": "custom", "name": "patch"}], "custom"),
        ("tools", [{"type": "function", "name": "bad name"}], "name"),
        ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice"),
        ("tool_choice", "required", "needs tools"),
        ("input", [{"type": "function_call_output", "output": "x"}], "call_id"),
        ("include", ["message.output_text.everything"], "include"),
        ("text", {"format": {"type": "grammar"}}, "text.format"),
        ("text", {"verbosity": "low"}, "verbosity"),
        ("conversation", "conv_1", "conversations"),
        ("prompt", {"id": "pmpt_1"}, "prompt"),
        ("frobnicate", 1, "unknown parameter"),
        ("metadata", {"k" * 65: "v"}, "metadata"),
        ("top_logprobs", 3, "include"),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input_image"),
        ("input", [], "input is empty"),
        ("max_output_tokens", 0, "max_output_tokens"),
        ("temperature", 2.5, "temperature"),
    ],
)
def test_what_cannot_be_honoured_is_400(door: InProcessDaemon, field: str, value: Any, says: str) -> None:
    body = {"model": MODEL, "input": "Hi", field: value}
    answer = httpx.post(base_url(door) + "/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert says in answer.json()["error"]["message"]


WEATHER = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]


def test_an_agent_step_calls_a_tool_and_its_output_continues_the_response(oai: openai.OpenAI) -> None:
    args = {"tools": WEATHER, "max_output_tokens": 60, "parallel_tool_calls": False}
    called = create(oai, "What is the weather in Paris?", tool_choice="required", **args)
    assert called.status == "completed" and called.output_text == ""
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 18}'}
    answered = create(oai, [result], previous_response_id=called.id, **args)  # type: ignore[arg-type]
    assert answered.output[0].type == "message" and answered.output_text
    assert answered.usage.input_tokens_details.cached_tokens >= called.usage.total_tokens - 1
    assert [i.type for i in oai.responses.input_items.list(answered.id)] == ["function_call_output"]
    # A branch from the call (its checkpoint) answers alike.
    again = create(oai, [result], previous_response_id=called.id, **args)  # type: ignore[arg-type]
    assert again.output_text == answered.output_text
    # The conversation resent whole, with the call as an item (nothing stored), is answered.
    item = {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    resent = create(
        oai,
        [{"role": "user", "content": "What is the weather in Paris?"}, item, result],  # type: ignore[arg-type]
        store=False,
        **args,
    )
    assert resent.status in ("completed", "incomplete") and resent.output[0].type == "message"
    # Streamed: the call's item, its arguments in pieces, and the helper's parsed arguments.
    with oai.responses.stream(
        model=MODEL, input="What is the weather in Rome?", tool_choice="required", **args
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments == final.output[0].arguments
    assert final.output[0].parsed_arguments == json.loads(pieces)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    replayed = list(oai.responses.retrieve(final.id, stream=True))
    assert [e.type for e in replayed if e.type != "response.function_call_arguments.delta"] == [
        e.type for e in events if e.type != "response.function_call_arguments.delta"
    ]


def test_a_response_cut_within_a_calls_arguments_continues_and_branches(oai: openai.OpenAI) -> None:
    """Cut short once the call's arguments began, the response is a checkpoint like another:
    continued in place, then branched from (its manifest read back), alike."""
    cut = create(
        oai, "What is the weather in Paris?", tools=WEATHER, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=22, temperature=0,
    )  # fmt: skip
    assert cut.status == "incomplete"
    replies = [
        create(oai, "Go on.", previous_response_id=cut.id, max_output_tokens=8, temperature=0)
        for _ in range(2)
    ]
    assert replies[0].status == replies[1].status == "incomplete"
    assert replies[0].output_text == replies[1].output_text


def test_unknown_responses_are_404_and_any_model_is_the_one_served(oai: openai.OpenAI) -> None:
    for rid in ("resp_" + "0" * 24, "resp_nonsense", "c_" + "0" * 24):
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            create(oai, "Hi", previous_response_id=rid)
    # Any model name is answered by the one model served, which the response names.
    assert oai.responses.create(model="gpt-4o", input="Hi", max_output_tokens=2).model == MODEL


def test_logprobs_when_included(oai: openai.OpenAI) -> None:
    r = create(oai, "Say yes.", include=["message.output_text.logprobs"], top_logprobs=2, max_output_tokens=4)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs)


def test_the_async_client(door: InProcessDaemon) -> None:
    async def run() -> tuple[str, str, str]:
        async with openai.AsyncOpenAI(base_url=base_url(door), api_key="unused", max_retries=0) as c:
            args = {"model": MODEL, "max_output_tokens": 10, "temperature": 0}
            first = await c.responses.create(input="Name a fish.", **args)
            text = ""
            async with c.responses.stream(input="Another.", previous_response_id=first.id, **args) as s:
                async for e in s:
                    if e.type == "response.output_text.delta":
                        text += e.delta
                final = await s.get_final_response()
            got = await c.responses.retrieve(final.id)
            return text, final.output_text, got.output_text

    streamed, final, got = asyncio.run(run())
    assert streamed == final == got


def test_another_tenants_response_is_an_unknown_one(tmp_path: Path, start_daemon: Callable[..., Any]) -> None:
    d = start_daemon(http_address="127.0.0.1:0", auth_file=write_auth(tmp_path / "auth.toml", TOKENS))
    url = base_url(d)
    alice = openai.OpenAI(base_url=url, api_key=TOKENS["alice"], max_retries=0)
    bob = httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKENS['bob']}"}, timeout=60)
    mine = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    unknown = "resp_" + secrets.token_hex(12)
    for rid in (mine.id, unknown):
        answers = [
            bob.get(f"/responses/{rid}"),
            bob.get(f"/responses/{rid}/input_items"),
            bob.delete(f"/responses/{rid}"),
            bob.post("/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": rid}),
        ]
        assert [a.status_code for a in answers] == [404] * 4
        assert {a.json()["error"]["message"].replace(rid, "ID") for a in answers} == {"no response 'ID'"}
    assert alice.responses.retrieve(mine.id).id == mine.id
    assert httpx.get(url + "/models").status_code == 401


def test_a_response_survives_kill_9_and_continues_exactly(spawn_daemon: Callable[..., DaemonProcess]) -> None:
    port = free_port()
    d = spawn_daemon("--http", f"127.0.0.1:{port}")
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    first = create(oai, "Which ship came in today?", temperature=0.9)
    second = create(oai, "And yesterday?", previous_response_id=first.id, temperature=0.9)
    here = create(oai, "And why?", previous_response_id=second.id, temperature=0.9, store=False)
    d.kill()
    d.start()
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    there = create(oai, "And why?", previous_response_id=second.id, temperature=0.9, store=False)
    assert there.output_text == here.output_text
    assert there.usage.input_tokens_details.cached_tokens == here.usage.input_tokens_details.cached_tokens
    with kvkeep.Client(d.address) as client:
        assert client.info().response_ttl_seconds == 30 * 24 * 3600


def test_responses_expire_by_their_ttl(start_daemon: Callable[..., InProcessDaemon]) -> None:
    d = start_daemon(http_address="127.0.0.1:0", response_ttl=1.0, sweep_interval=0.2)
    oai = openai.OpenAI(base_url=base_url(d), api_key="unused", max_retries=0)
    r = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    assert d.daemon is not None
    blocks = d.daemon.manager.stores.durable.catalog.known_blocks()
    assert blocks
    wait_until(lambda: stored_responses(d) == 0 or None, 20, "the response to expire")
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    assert not d.daemon.manager.stores.durable.catalog.known_blocks() & blocks


def test_daemons_sharing_a_catalog_continue_each_others_responses(
    start_daemon: Callable[..., InProcessDaemon], redis_server: str
) -> None:
    shared = {
        "catalog": f"{redis_server}?prefix=responses-{secrets.token_hex(6)}",
        "store": redis_server,
        "store_key": secrets.token_hex(32),
        "http_address": "127.0.0.1:0",
    }
    a, b = start_daemon(daemon_name="a", **shared), start_daemon(daemon_name="b", **shared)
    on_a = openai.OpenAI(base_url=base_url(a), api_key="unused", max_retries=0)
    on_b = openai.OpenAI(base_url=base_url(b), api_key="unused", max_retries=0)
    first = create(on_a, "Which ship came in today?", temperature=0.9)
    here = create(on_a, "And yesterday?", previous_response_id=first.id, temperature=0.9, store=False)
    there = create(on_b, "And yesterday?", previous_response_id=first.id, temperature=0.9)
    assert there.output_text == here.output_text
    assert resumes(b).get("shared") == 1
    assert on_a.responses.retrieve(there.id).output_text == there.output_text
