"""LangChain: ChatKvkeep keeps its conversation in a session, KvkeepChatMessageHistory in a
persistent one; against the shared daemon, compared with the SDK's own sessions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from daemons import GREEDY, DaemonProcess
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from pydantic import BaseModel, Field

import kvkeep
from kvkeep import Message
from kvkeep.integrations.langchain import ChatKvkeep, KvkeepChatMessageHistory

SYSTEM = "You are terse."


def make(daemon_address: str, **kw: object) -> ChatKvkeep:
    return ChatKvkeep(address=daemon_address, **{"temperature": 0, "max_tokens": 10, **kw})  # type: ignore[arg-type]


def usage(m: BaseMessage) -> dict[str, int]:
    assert isinstance(m, AIMessage) and m.usage_metadata is not None
    return {
        "in": m.usage_metadata["input_tokens"],
        "cached": m.usage_metadata["input_token_details"]["cache_read"],
    }


def test_a_conversation_is_continued_not_resent(daemon_address: str, client: kvkeep.Client) -> None:
    chat = make(daemon_address)
    history: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage("Name a colour.")]
    first = chat.invoke(history)
    assert first.response_metadata["session_id"] == chat.session_id
    n_first = client.session(chat.session_id or "").info().n_tokens
    history += [first, HumanMessage("Name an animal.")]
    second = chat.invoke(history)
    # Only the new message was sent and evaluated: the history was kept (all of it but the
    # last token drawn, which is evaluated next).
    assert usage(second)["cached"] == n_first - 1

    reference = client.create_session(SYSTEM, sampling=GREEDY)
    assert reference.chat("Name a colour.", max_tokens=10).text == first.content
    assert reference.chat("Name an animal.", max_tokens=10).text == second.content
    assert client.session(chat.session_id or "").info().messages == reference.info().messages
    reference.close()
    client.session(chat.session_id or "").close()


def test_an_edited_conversation_rewinds(daemon_address: str, client: kvkeep.Client) -> None:
    chat = make(daemon_address)
    first = chat.invoke([SystemMessage(SYSTEM), HumanMessage("Name a colour.")])
    n_first = client.session(chat.session_id or "").info().n_tokens
    chat.invoke(
        [SystemMessage(SYSTEM), HumanMessage("Name a colour."), first, HumanMessage("Name an animal.")]
    )
    edited: list[BaseMessage] = [
        SystemMessage(SYSTEM),
        HumanMessage("Name a colour."),
        first,
        HumanMessage("Name a city."),
    ]
    redo = chat.invoke(edited)
    assert usage(redo)["cached"] >= n_first - 1
    fresh = client.create_session(sampling=GREEDY)
    whole = [
        Message("system", SYSTEM),
        Message("user", "Name a colour."),
        Message("assistant", str(first.content)),
    ]
    assert fresh.chat([*whole, Message("user", "Name a city.")], max_tokens=10).text == redo.content
    held = client.session(chat.session_id or "").info().messages
    assert [m.content for m in held] == [
        SYSTEM,
        "Name a colour.",
        first.content,
        "Name a city.",
        redo.content,
    ]
    # Another conversation altogether, on the same object, starts over in the same session.
    other = chat.invoke([HumanMessage("Say yes.")])
    assert client.session(chat.session_id or "").info().messages[-1].content == other.content
    fresh.close()
    client.session(chat.session_id or "").close()


def test_streaming_stop_and_asyncio(daemon_address: str, client: kvkeep.Client) -> None:
    ask = [HumanMessage("Write the numbers 1 to 20 separated by commas.")]
    whole = make(daemon_address, max_tokens=30).invoke(ask)
    chunks = list(make(daemon_address, max_tokens=30).stream(ask))
    assert "".join(str(c.content) for c in chunks) == whole.content
    ends = [c for c in chunks if c.usage_metadata is not None]
    assert len(ends) == 1 and ends[0].response_metadata["finish_reason"] in ("length", "eos")
    text = str(whole.content)
    cut = make(daemon_address, max_tokens=30).invoke(ask, stop=["5"])
    assert cut.content == text[: text.index("5")]

    models = [make(daemon_address, max_tokens=30) for _ in range(2)]

    async def run() -> tuple[str, str]:
        first = await models[0].ainvoke(ask)
        turn = [*ask, first, HumanMessage("Again.")]
        streamed = "".join([str(c.content) async for c in models[0].astream(turn)])
        await models[0].aclose()
        return str(first.content), streamed

    first, streamed = asyncio.run(run())
    assert first == whole.content
    # The same turn on a fresh object (a new session given the whole conversation).
    again = models[1].invoke([*ask, AIMessage(first), HumanMessage("Again.")])
    assert streamed == again.content
    for m in models:
        client.session(m.session_id or "").close()


def test_unsupported_messages_are_refused(daemon_address: str) -> None:
    with pytest.raises(ValueError, match="function"):
        make(daemon_address).invoke([HumanMessage("Hi"), FunctionMessage("42", name="f")])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValueError, match="image_url"):
        make(daemon_address).invoke([HumanMessage([{"type": "text", "text": "What is this?"}, image])])


def test_a_message_history_in_a_persistent_session(
    spawn_daemon: Callable[..., DaemonProcess],
) -> None:
    d = spawn_daemon()
    history = KvkeepChatMessageHistory(address=d.address)
    history.add_messages([SystemMessage(SYSTEM), HumanMessage("Name a colour.")])
    history.add_ai_message("Teal.")
    expected = [SystemMessage(SYSTEM), HumanMessage("Name a colour."), AIMessage("Teal.")]
    assert history.messages == expected

    d.restart()  # SIGTERM, then the same state directory and port
    again = KvkeepChatMessageHistory(history.session_id, address=d.address)
    assert again.messages == expected
    # A model going on with the stored conversation gives what a fresh session gives.
    chat = ChatKvkeep(address=d.address, temperature=0, max_tokens=8)
    reply = chat.invoke([*again.messages, HumanMessage("Another.")])
    with kvkeep.Client(d.address, timeout=60) as c:
        fresh = c.create_session(sampling=GREEDY)
        given = [Message("system", SYSTEM), Message("user", "Name a colour."), Message("assistant", "Teal.")]
        assert fresh.chat([*given, Message("user", "Another.")], max_tokens=8).text == reply.content
    again.clear()
    assert again.messages == []
    assert KvkeepChatMessageHistory(history.session_id, address=d.address).messages == []


class Weather(BaseModel):
    """The weather of a city."""

    city: str = Field(max_length=16)
    celsius: int = Field(ge=-50, le=50)


def test_tools_calls_their_chunks_and_results(daemon_address: str, client: kvkeep.Client) -> None:
    chat = make(daemon_address, max_tokens=60)
    bound = chat.bind_tools([Weather], tool_choice="any")
    ask: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage("Weather in Paris?")]
    reply = bound.invoke(ask)
    assert isinstance(reply, AIMessage) and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["name"] == "Weather" and Weather(**call["args"])
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    # The model's name, for LangChain's usage callbacks and tracing.
    name = reply.response_metadata["model_name"]
    assert name and chat._get_ls_params()["ls_model_name"] == name
    # Streamed: the call's chunks, its name and id first, join into the same call.
    chunks = list(bound.stream(ask))
    assert chunks[0].tool_call_chunks == [] or chunks[0].tool_call_chunks[0]["name"] == "Weather"
    pieces = [c for chunk in chunks for c in chunk.tool_call_chunks]
    assert pieces[0]["name"] == "Weather" and pieces[0]["id"] == call["id"] and len(pieces) >= 3
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined += chunk
    assert joined.tool_calls == reply.tool_calls
    # The result goes back as a ToolMessage; the session holds the call and evaluates only it.
    n = client.session(chat.session_id or "").info().n_tokens
    answer = chat.bind_tools([Weather]).invoke(
        [*ask, reply, ToolMessage('{"celsius": 21}', tool_call_id=call["id"])]
    )
    assert answer.content and not answer.tool_calls
    assert usage(answer)["cached"] >= n - 1
    client.session(chat.session_id or "").close()


def test_structured_output_by_json_schema(daemon_address: str) -> None:
    chat = make(daemon_address, max_tokens=40)
    weather = chat.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(weather, Weather)
    raw = chat.with_structured_output(Weather.model_json_schema(), method="json_schema", include_raw=True)
    out = raw.invoke("Weather in Rome?")
    assert out["parsing_error"] is None and Weather(**out["parsed"]) and isinstance(out["raw"], AIMessage)
