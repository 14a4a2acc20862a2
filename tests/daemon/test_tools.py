"""Tool calls through gRPC and the SDK, on the default model (whose template renders no
tools: the generic format writes them into the system prompt and the model calls them in
the hermes syntax).

What is checked: calls under "required" and a named function validate against their tool's
schema (jsonschema), stream as pieces that join to the same calls, and are the same for the
same seed; "auto" lets the model answer or call (a few-shot conversation makes the 135M model
call), and once it opens a call the rest is held to the schema; "none" never calls; a result
fed back is answered, the session keeping its tools and evaluating only the result; a reply
cut short in the middle of a call continues within it, the same as uninterrupted, after a
checkpoint is restored, in a fork, swapped out, and after kill -9 of a persistent session;
bad tools are INVALID_ARGUMENT before anything changes; manifests carry tools and calls.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from checkpoint_helpers import SPAWN_ARGS
from click.testing import CliRunner
from daemons import DaemonProcess, InProcessDaemon

import kvkeep
from kvkeep import Message, Tool, ToolCall
from kvkeep.cli import main
from kvkeepd.errors import CorruptCheckpoint
from kvkeepd.request_limits import MAX_TOOLS
from kvkeepd.state.manifest import Snapshot, decode, encode
from kvkeepd.values.constraints import Constraint, GrammarSpec
from kvkeepd.values.messages import ChatMessage
from kvkeepd.values.sampling import SamplingParams
from kvkeepd.values.toolcall import Tool as DaemonTool
from kvkeepd.values.toolcall import ToolCall as DaemonCall

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = Tool("get_weather", "The current weather of a city.", WEATHER_SCHEMA)
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TIME = Tool("get_time", "The time in a time zone.", TIME_SCHEMA)
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
SYSTEM = "You are a helpful assistant."
HOT = kvkeep.SamplingParams(temperature=0.9, seed=4242)
GREEDY = kvkeep.SamplingParams(temperature=0.0)
LIMIT = 160


def few_shot(tool: Tool = WEATHER) -> list[Message]:
    """Earlier turns in which the assistant called the tool: the 135M model follows them."""
    out: list[Message] = []
    for city, degrees in (("Rome", 25), ("Oslo", 3), ("Lima", 18)):
        call_id = f"call_{city.lower()}"
        args = json.dumps({"city": city, "unit": "celsius"})
        out += [
            Message("user", f"What is the weather in {city}?"),
            Message("assistant", "", (ToolCall(call_id, tool.name, args),)),
            Message("tool", json.dumps({"temperature": degrees}), tool_call_id=call_id),
            Message("assistant", f"It is {degrees} degrees in {city}."),
        ]
    return out


def whole_calls(reply: kvkeep.Completion) -> tuple[ToolCall, ...]:
    """The calls of a reply, less the last one where the reply was cut short."""
    return reply.tool_calls if reply.finish_reason == "tool_calls" else reply.tool_calls[:-1]


def valid(calls: tuple[ToolCall, ...]) -> None:
    assert calls
    for call in calls:
        assert call.call_id and call.name in SCHEMAS
        jsonschema.validate(call.args(), SCHEMAS[call.name])


def test_info_names_the_generic_format(client: kvkeep.Client) -> None:
    assert client.info().tool_format == "generic"


def test_required_calls_validate_stream_as_the_whole_reply_and_repeat_with_their_seed(
    client: kvkeep.Client,
) -> None:
    replies = []
    for stream in (False, True):
        s = client.create_session(SYSTEM, tools=[WEATHER, TIME], sampling=HOT)
        question = "Weather in Oslo and the time in Tokyo?"
        if stream:
            chunks = list(s.chat_stream(question, tool_choice="required", max_tokens=110))
            calls = s.info().messages[-1].tool_calls
            for i, call in enumerate(calls):  # each call's id and name first, then its arguments
                pieces = [p for c in chunks for p in c.tool_calls if p.index == i]
                assert (pieces[0].call_id, pieces[0].name, pieces[0].arguments) == (
                    call.call_id,
                    call.name,
                    "",
                )
                assert len(pieces) >= 3 and "".join(p.arguments for p in pieces) == call.arguments
            token_ids = tuple(t for c in chunks for t in c.token_ids)
            replies.append((token_ids, calls, chunks[-1].finish_reason))
        else:
            reply = s.chat(question, tool_choice="required", max_tokens=110)
            replies.append((reply.token_ids, reply.tool_calls, reply.finish_reason))
            whole = whole_calls(reply)
            assert len(whole) >= 2  # this model calls again and again: several calls, one by one
            valid(whole)
            assert len({c.call_id for c in reply.tool_calls}) == len(reply.tool_calls)
        s.close()
    assert replies[0] == replies[1]


def test_a_named_function_is_the_one_call(client: kvkeep.Client) -> None:
    s = client.create_session(SYSTEM, sampling=HOT)
    reply = s.chat(
        "What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice="get_time", max_tokens=60
    )
    s.close()
    assert reply.finish_reason == "tool_calls"
    assert [c.name for c in reply.tool_calls] == ["get_time"]
    valid(reply.tool_calls)


def test_auto_calls_after_examples_and_a_result_fed_back_is_answered(client: kvkeep.Client) -> None:
    conversation = [*few_shot(), Message("user", "What is the weather in Paris?")]
    s = client.create_session(SYSTEM, tools=[WEATHER], sampling=GREEDY)
    try:
        first = s.chat(conversation, max_tokens=LIMIT)
        assert first.finish_reason == "tool_calls" and first.text == ""
        valid(first.tool_calls)
        assert first.tool_calls[0].args()["city"] == "Paris"
        held = s.info()
        assert held.tools == (WEATHER,)
        assert held.messages[-1] == Message("assistant", "", first.tool_calls)

        # tool_choice none: the same conversation (its prefix from the cache), answered in text.
        other = client.create_session(SYSTEM, tools=[WEATHER], sampling=GREEDY)
        none = other.chat(conversation, tool_choice="none", max_tokens=24)
        other.close()
        assert not none.tool_calls and none.finish_reason != "tool_calls"

        result = Message("tool", json.dumps({"temperature": 21}), tool_call_id=first.tool_calls[0].call_id)
        answer = s.chat([result], max_tokens=24)  # nothing but the result: the session keeps its tools
        assert answer.text and not answer.tool_calls
        # The calls as the template writes them are the tokens the model wrote: only the
        # result is evaluated.
        assert answer.usage.reused_tokens >= held.n_tokens - 1
        assert s.info().messages[-3:-1] == (held.messages[-1], result)
        # Another turn may change the tools, or drop them.
        s.chat("Thanks.", tools=[], max_tokens=4)
        assert s.info().tools == ()
    finally:
        s.close()


def test_auto_holds_an_opened_call_to_its_schema_and_answers_in_text(client: kvkeep.Client) -> None:
    # Once the call is opened, only what the schema allows follows: not "Paris".
    properties = {"city": {"enum": ["Rome", "Oslo"]}, "unit": {"enum": ["celsius"]}}
    narrow = Tool("get_weather", WEATHER.description, {**WEATHER_SCHEMA, "properties": properties})
    s = client.create_session(SYSTEM, tools=[narrow], sampling=GREEDY)
    try:
        reply = s.chat([*few_shot(), Message("user", "What is the weather in Paris?")], max_tokens=60)
        assert reply.tool_calls and reply.tool_calls[0].args()["city"] in ("Rome", "Oslo")
        # Free text is free: asked for nothing a tool does, the model answers.
        text = s.chat("Say hello.", max_tokens=16)
        assert text.text and not text.tool_calls and text.finish_reason != "tool_calls"
    finally:
        s.close()


def test_a_call_cut_short_continues_exactly_after_restore_in_a_fork_and_swapped_out(
    start_daemon: Callable[..., InProcessDaemon],
) -> None:
    d = start_daemon(slots=1)
    with kvkeep.Client(d.address, timeout=60) as client:
        options: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
        ref = client.create_session(SYSTEM, tools=[WEATHER], sampling=HOT)
        whole = ref.chat("What is the weather in Paris?", max_tokens=LIMIT, **options)
        ref.close()
        assert whole.finish_reason == "tool_calls" and len(whole.token_ids) > 16, whole
        s = client.create_session(SYSTEM, tools=[WEATHER], sampling=HOT)
        part = s.chat("What is the weather in Paris?", max_tokens=14, **options)
        assert part.finish_reason == "length"
        ck = s.checkpoint("mid-call")
        other = client.create_session("Another conversation.")
        other.complete("Once upon a time", max_tokens=4)  # takes the one slot: s is swapped out
        rest = s.complete("", max_tokens=LIMIT)  # no prompt: the open call continues
        assert rest.finish_reason == "tool_calls"
        assert list(part.token_ids) + list(rest.token_ids) == list(whole.token_ids)
        # The reply's message holds the whole call, named as the uninterrupted one.
        assert s.info().messages[-1].tool_calls == whole.tool_calls
        s.restore(ck.checkpoint_id)
        assert s.complete("", max_tokens=LIMIT).token_ids == rest.token_ids
        assert s.info().messages[-1].tool_calls == whole.tool_calls
        fork = s.fork(ck.checkpoint_id)
        assert fork.complete("", max_tokens=LIMIT).token_ids == rest.token_ids
        assert fork.info().messages[-1].tool_calls == whole.tool_calls
        for x in (fork, s, other):
            x.close()


def test_a_checkpoint_cut_in_the_middle_of_a_calls_arguments_forks_and_restores(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    """A persistent reply cut short once the call's arguments have begun (so its message holds
    arguments that are not yet JSON) is streamed whole, once, and is a checkpoint like any other:
    read back from disk after a restart, the session is there, and the checkpoint forks and
    restores and continues within the call."""
    proc = spawn_daemon(*SPAWN_ARGS)
    options: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
    with kvkeep.Client(proc.address, timeout=60) as client:
        ref = client.create_session(SYSTEM, tools=[WEATHER], sampling=HOT)
        whole = ref.chat("What is the weather in Paris?", max_tokens=LIMIT, **options)
        assert whole.finish_reason == "tool_calls", whole
        ref.close()
        # The first length at which the reply's message holds the call with arguments begun.
        for n in range(8, len(whole.token_ids)):
            s = client.create_session(SYSTEM, tools=[WEATHER], sampling=HOT, persistent=True)
            part = s.chat("What is the weather in Paris?", max_tokens=n, **options)
            calls = s.info().messages[-1].tool_calls
            if calls and calls[-1].arguments:
                break
            s.close()
        else:
            pytest.fail("no reply was cut in the middle of its call's arguments")
        with pytest.raises(ValueError):
            json.loads(calls[-1].arguments)
        # A persistent turn's last tokens go out before it is made durable, its finish after:
        # no piece of the call is sent twice.
        assert part.tool_calls == calls
        ck = s.checkpoint("mid-arguments")
    assert proc.kill() == -9
    proc.start()  # the checkpoint and the session are read back from disk
    with kvkeep.Client(proc.address, timeout=60) as client:
        rest = list(whole.token_ids[len(part.token_ids) :])
        fork = client.session(s.session_id).fork(ck.checkpoint_id)
        assert list(fork.complete("", max_tokens=LIMIT).token_ids) == rest
        assert fork.info().messages[-1].tool_calls == whole.tool_calls
        resumed = client.session(s.session_id)
        resumed.restore(ck.checkpoint_id)
        assert list(resumed.complete("", max_tokens=LIMIT).token_ids) == rest


def test_a_persistent_session_continues_within_its_call_after_kill_9(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    proc = spawn_daemon(*SPAWN_ARGS)
    options: dict[str, Any] = {"tool_choice": "required", "parallel_tool_calls": False}
    with kvkeep.Client(proc.address, timeout=60) as client:
        s = client.create_session(SYSTEM, tools=[WEATHER], sampling=HOT, persistent=True)
        part = s.chat("What is the weather in Paris?", max_tokens=12, **options)
        assert part.finish_reason == "length"
        expected = s.fork().complete("", max_tokens=LIMIT)  # an ephemeral copy: nothing on disk
        assert expected.finish_reason == "tool_calls"
    assert proc.kill() == -9
    proc.start()
    with kvkeep.Client(proc.address, timeout=60) as client:
        resumed = client.session(s.session_id)
        assert resumed.info().tools == (WEATHER,)
        rest = resumed.complete("", max_tokens=LIMIT)
        assert rest.token_ids == expected.token_ids
        valid(resumed.info().messages[-1].tool_calls)


def test_async_client_streams_calls(daemon_address: str) -> None:
    async def run() -> tuple[ToolCall, ...]:
        async with kvkeep.AsyncClient(daemon_address, timeout=30) as client:
            s = await client.create_session(SYSTEM, sampling=HOT)
            stream = s.chat_stream(
                "Weather in Paris?",
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=60,
            )
            deltas = [d async for c in stream for d in c.tool_calls]
            calls = (await s.info()).messages[-1].tool_calls
            await s.close()
            assert deltas and "".join(d.arguments for d in deltas if d.index == 0) == calls[0].arguments
            return calls

    valid(asyncio.run(run()))


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"tools": [Tool("f", "", {"properties": {"a": {"type": "strang"}}})], "tool_choice": "required"},
        "schema is invalid",
    ),
    ({"tools": [Tool("f", "", {"properties": {"a": {"$ref": "#/nowhere"}}})]}, "schema is invalid"),
    ({"tools": [Tool("f", "", {"type": "string"})]}, "JSON schema of an object"),
    ({"tools": [Tool("f"), Tool("f")]}, "two tools"),
    ({"tools": [Tool("no spaces")]}, "name"),
    ({"tools": [Tool(f"f{i}") for i in range(MAX_TOOLS + 1)]}, "at most"),
    ({"tools": [WEATHER], "tool_choice": "get_time"}, "none of the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    # A JSON schema goes with tools (the answer's); a grammar does not.
    ({"tools": [WEATHER], "grammar": 'root ::= "yes"'}, "not both"),
    ({"tools": [WEATHER], "tool_choice": "maybe"}, "none of the tools"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_tools_are_refused_before_anything_changes(
    client: kvkeep.Client, kwargs: dict[str, Any], message: str
) -> None:
    s = client.create_session(SYSTEM, sampling=GREEDY)
    try:
        before = s.info()
        with pytest.raises(kvkeep.InvalidRequestError, match=message):
            s.chat("Hello", max_tokens=4, **kwargs)
        after = s.info()
        assert (after.n_tokens, after.messages, after.tools) == (
            before.n_tokens,
            before.messages,
            before.tools,
        )
        assert s.chat("Hello", max_tokens=2).token_ids  # and the daemon still serves
    finally:
        s.close()


@pytest.mark.parametrize(
    "messages,match",
    [
        ([Message("tool", "42")], "names the call"),
        ([Message("user", "hi", tool_call_id="call_1")], "names the call"),
        ([Message("user", "hi", (ToolCall("c1", "f", "{}"),))], "only assistant"),
        ([Message("assistant", "", (ToolCall("c1", "f", "[1]"),))], "JSON object"),
        ([Message("assistant", "", (ToolCall("c 1", "f", "{}"),))], "id"),
    ],
)
def test_bad_messages_with_calls_are_refused(
    client: kvkeep.Client, messages: list[Message], match: str
) -> None:
    s = client.create_session(SYSTEM)
    try:
        with pytest.raises(kvkeep.InvalidRequestError, match=match):
            s.chat(messages, max_tokens=2)
    finally:
        s.close()


def test_manifests_carry_tools_calls_and_the_open_call() -> None:
    key = b"k" * 32
    tool = DaemonTool("get_weather", "Weather.", json.dumps(WEATHER_SCHEMA))
    call = DaemonCall("call_1", "get_weather", '{"city": "Paris"}')
    snap = Snapshot(
        session_id="s",
        persistent=False,
        created_at=0.0,
        tokens=[1, 2, 3, 4],
        n_kv=4,
        logits=None,
        draws=2,
        params=SamplingParams(seed=1),
        stop=(),
        messages=[
            ChatMessage("assistant", "", 1, (call,)),
            ChatMessage("tool", "21", 2, tool_call_id="call_1"),
            ChatMessage("assistant", "", 3),
        ],
        fingerprint="f",
        kv_layout=None,
        block_tokens=64,
        constraint=Constraint(GrammarSpec("tools", 'start: "x"'), 3, "abcd"),
        tools=(tool,),
    )
    back = decode(encode(snap, key), key, 100)
    assert (back.tools, back.messages, back.constraint) == (snap.tools, snap.messages, snap.constraint)
    for bad in (
        {"tools": [["no spaces", "", ""]]},
        {"tools": [["f", "", "[1]"]]},
        {"tools": "x"},
        {"messages": [{"role": "tool", "content": "x", "start": 0}]},
        {"messages": [{"role": "assistant", "content": "", "start": 0, "tool_calls": [["c1", "f"]]}]},
    ):
        meta_snap = Snapshot(**{**snap.__dict__})
        data = encode(meta_snap, key)
        from checkpoint_helpers import edit_manifest, remac

        def edit(meta: dict[str, Any], bad: dict[str, Any] = bad) -> None:
            meta.update(bad)

        with pytest.raises(CorruptCheckpoint):
            decode(remac(edit_manifest(data, edit), key), key, 100)


def test_cli_run_with_tools(daemon_address: str, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(
        json.dumps([{"type": "function", "function": {"name": WEATHER.name, "parameters": WEATHER_SCHEMA}}])
    )
    args = ["run", "Weather in Paris?", "--seed", "3", "--tools", str(tools), "--tool-choice", "required"]
    result = CliRunner().invoke(main, ["--address", daemon_address, *args, "--max-tokens", "60"])
    assert result.exit_code == 0, result.output
    calls = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert calls and all(c["name"] == "get_weather" for c in calls)
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_SCHEMA)
    bad = CliRunner().invoke(main, ["--address", daemon_address, "run", "Hi", "--tool-choice", "none"])
    assert bad.exit_code != 0 and "--tools" in bad.output
