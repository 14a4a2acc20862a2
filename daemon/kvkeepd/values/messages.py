"""Messages of a conversation: roles, a message and a session's recorded one, their checks,
and what a chat turn that does not fit does (context policies)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_MESSAGES
from kvkeepd.values.toolcall import ToolCall, check_call_id, check_calls

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)
#: What a chat turn that does not fit the session's context does: refused, or earlier turns
#: dropped (sessions/prompting/fitting.py).
ContextPolicy = Literal["error", "truncate"]
CONTEXT_POLICIES: tuple[ContextPolicy, ...] = get_args(ContextPolicy)


def context_policy(name: str) -> ContextPolicy:
    """The policy of that name ("" is the default, "error"); InvalidRequest otherwise."""
    for policy in CONTEXT_POLICIES:
        if name == policy:
            return policy
    if not name:
        return "error"
    raise InvalidRequest(f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, not {name[:40]!r}")


@dataclass(frozen=True)
class Message:
    """A message of a conversation: an assistant's may carry the tool calls it made, and a
    tool's result names the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass
class ChatMessage:
    """A recorded message of a session and the history index where its tokens begin."""

    role: str
    content: str
    start: int
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""

    def message(self) -> Message:
        return Message(self.role, self.content, self.tool_calls, self.tool_call_id)


def check_messages(messages: Sequence[Message], *, whole: bool = True) -> None:
    """InvalidRequest unless there are not too many messages, each of a known role; tool
    calls only in assistant messages (checked by `check_calls`, `whole` as there), and a
    tool's result naming its call."""
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for m in messages:
        if m.role not in ROLES:
            raise InvalidRequest(
                f"a message's role must be one of {', '.join(ROLES)}, not {m.role[:40]!r}", "messages"
            )
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequest("only assistant messages carry tool calls", "messages")
            check_calls(m.tool_calls, whole=whole)
        if (m.role == "tool") != bool(m.tool_call_id):
            raise InvalidRequest(
                "a tool message, and only a tool message, names the call it answers", "messages"
            )
        if m.tool_call_id:
            check_call_id(m.tool_call_id)
