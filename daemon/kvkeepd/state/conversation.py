"""A manifest's conversation: a session's messages (with the calls a reply made and the call a
tool result answers) and the tools its turns may call, as JSON values, and back, every field
checked as strictly as an RPC argument (a manifest may come from an import)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvkeepd.errors import CorruptCheckpoint, KvkeepError
from kvkeepd.values.messages import ROLES, ChatMessage, Message, check_messages
from kvkeepd.values.toolcall import Tool, ToolCall, check_tools


def messages_value(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        value: dict[str, Any] = {"role": m.role, "content": m.content, "start": m.start}
        if m.tool_calls:
            value["tool_calls"] = [[c.call_id, c.name, c.arguments] for c in m.tool_calls]
        if m.tool_call_id:
            value["tool_call_id"] = m.tool_call_id
        out.append(value)
    return out


def tools_value(tools: Sequence[Tool]) -> list[list[str]]:
    return [[t.name, t.description, t.parameters] for t in tools]


def messages_of(value: object) -> list[ChatMessage]:
    """The messages of a manifest (tool calls absent in manifests older than tools)."""
    if not isinstance(value, list):
        raise CorruptCheckpoint("the manifest field 'messages' is missing or has the wrong type")
    messages = []
    for m in value:
        if not isinstance(m, dict):
            raise CorruptCheckpoint("a checkpoint message is not an object")
        role, content, start = m.get("role"), m.get("content"), m.get("start")
        if not isinstance(role, str) or role not in ROLES:
            raise CorruptCheckpoint(f"a checkpoint message has role {str(role)[:20]!r}")
        if not isinstance(content, str) or type(start) is not int:
            raise CorruptCheckpoint("a checkpoint message is malformed")
        calls = tuple(
            ToolCall(*c) for c in _rows(m.get("tool_calls", []), "a checkpoint message's tool calls")
        )
        call_id = m.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise CorruptCheckpoint("a checkpoint message's tool call id is malformed")
        messages.append(ChatMessage(role, content, start, calls, call_id))
    try:
        # whole=False: the reply may have been cut short within a call's arguments.
        check_messages([Message(m.role, "", m.tool_calls, m.tool_call_id) for m in messages], whole=False)
    except KvkeepError as e:
        raise CorruptCheckpoint(f"the checkpoint's messages are malformed: {e}") from None
    return messages


def tools_of(value: object) -> tuple[Tool, ...]:
    """The session's tools in a manifest (none in manifests older than tools)."""
    tools = tuple(Tool(*t) for t in _rows(value, "the checkpoint's tools"))
    try:
        return check_tools(tools)
    except KvkeepError as e:
        raise CorruptCheckpoint(f"the checkpoint's tools are malformed: {e}") from None


def _rows(value: object, what: str) -> list[list[str]]:
    """A list of rows of three strings."""
    if not isinstance(value, list) or not all(
        isinstance(row, list) and len(row) == 3 and all(isinstance(x, str) for x in row) for row in value
    ):
        raise CorruptCheckpoint(f"{what} are malformed")
    return value
