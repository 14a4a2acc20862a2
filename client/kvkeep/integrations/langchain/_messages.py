"""LangChain's messages, tools and tool choices as kvkeep's, and a reply's pieces back as
LangChain's messages and chunks."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.utils.function_calling import convert_to_openai_tool

from kvkeep._types import Message, Tool, ToolCall, ToolCallDelta, Usage

#: LangChain's ways of forcing a call, as kvkeep's tool_choice has them.
_CHOICES = {"any": "required", "required": "required", "auto": "auto", "none": "none"}


def from_langchain(message: BaseMessage) -> Message:
    """A LangChain message as a kvkeep Message: system, human, AI (with its tool calls), tool
    results and chat messages of those roles; ValueError for others, and for content that is
    not text."""
    if isinstance(message, SystemMessage):
        role = "system"
    elif isinstance(message, HumanMessage):
        role = "user"
    elif isinstance(message, AIMessage):
        return Message("assistant", _text(message), _calls(message))
    elif isinstance(message, ToolMessage):
        return Message("tool", _text(message), tool_call_id=message.tool_call_id)
    elif isinstance(message, ChatMessage) and message.role in ("system", "user", "assistant"):
        role = message.role
    else:
        raise ValueError(f"kvkeep sessions hold system, human, AI and tool messages, not {message.type!r}")
    return Message(role, _text(message))


def to_langchain(message: Message) -> BaseMessage:
    """A kvkeep Message as a LangChain message."""
    if message.role == "system":
        return SystemMessage(message.content)
    if message.role == "user":
        return HumanMessage(message.content)
    if message.role == "assistant":
        return ai_message(message.content, message.tool_calls)
    if message.role == "tool":
        return ToolMessage(message.content, tool_call_id=message.tool_call_id or "")
    return ChatMessage(content=message.content, role=message.role)


def _text(message: BaseMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, Mapping) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif not (
            isinstance(message, AIMessage) and isinstance(block, Mapping) and block.get("type") == "tool_use"
        ):
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise ValueError(f"kvkeep sessions hold text, not {kind!r} content")
    return "".join(parts)


def _calls(message: AIMessage) -> tuple[ToolCall, ...]:
    """An AI message's calls, their arguments as the model wrote them where the message
    kept that text (the exact text keeps the session's history matching)."""
    written = {
        c.get("id"): c.get("function", {}).get("arguments")
        for c in message.additional_kwargs.get("tool_calls", ())
        if isinstance(c, Mapping)
    }
    out = []
    for i, c in enumerate(message.tool_calls):
        call_id = c.get("id") or f"call_{i}"
        arguments = written.get(call_id)
        if not isinstance(arguments, str) or _loads(arguments) != c["args"]:
            arguments = json.dumps(c["args"], ensure_ascii=False)
        out.append(ToolCall(call_id, c["name"], arguments))
    return tuple(out)


def kvkeep_tools(tools: Sequence[Any]) -> list[Tool]:
    """Tools in any form LangChain takes (a BaseTool, a function, a Pydantic class, a
    TypedDict, an OpenAI tool or a JSON schema) as kvkeep Tools."""
    out = []
    for t in tools:
        function = convert_to_openai_tool(t)["function"]
        out.append(Tool(function["name"], function.get("description", ""), function.get("parameters")))
    return out


def tool_choice(choice: Any, tools: Sequence[Tool]) -> str | None:
    """LangChain's tool_choice as kvkeep's: "any"/"required"/True force a call (of the one
    tool, if there is one), "auto", "none", a tool's name, or OpenAI's
    {"type": "function", "function": {"name": ...}}."""
    if choice is None or choice is False:
        return None
    if choice is True:
        return tools[0].name if len(tools) == 1 else "required"
    if isinstance(choice, str):
        return _CHOICES.get(choice, choice)
    if isinstance(choice, Mapping):
        name = choice.get("function", {}).get("name") if "function" in choice else choice.get("name")
        if isinstance(name, str):
            return name
    raise ValueError(f"tool_choice {choice!r} is none of 'auto', 'none', 'any', 'required' or a tool")


def ai_message(
    text: str,
    calls: Sequence[ToolCall],
    usage: Usage | None = None,
    metadata: dict[str, Any] | None = None,
) -> AIMessage:
    """A reply as an AIMessage: its calls as tool_calls (a call cut short, whose arguments
    are not whole, as an invalid tool call), and as OpenAI's in additional_kwargs."""
    parsed, invalid = [], []
    for c in calls:
        args = _loads(c.arguments)
        if isinstance(args, dict):
            parsed.append(tool_call(name=c.name, args=args, id=c.call_id))
        else:
            invalid.append(invalid_tool_call(name=c.name, args=c.arguments, id=c.call_id, error="cut short"))
    extra = {"tool_calls": [_openai_call(c) for c in calls]} if calls else {}
    return AIMessage(
        content=text,
        tool_calls=parsed,
        invalid_tool_calls=invalid,
        additional_kwargs=extra,
        usage_metadata=langchain_usage(usage) if usage is not None else None,
        response_metadata=metadata or {},
    )


def ai_chunk(
    text: str,
    deltas: Sequence[ToolCallDelta],
    usage: Usage | None = None,
    metadata: dict[str, Any] | None = None,
) -> AIMessageChunk:
    """A streamed piece as an AIMessageChunk: the calls' pieces as tool_call_chunks (a
    call's first with its name and id), the last chunk marked so."""
    chunks = [
        tool_call_chunk(name=d.name or None, args=d.arguments, id=d.call_id or None, index=d.index)
        for d in deltas
    ]
    last = metadata is not None
    return AIMessageChunk(
        content=text,
        tool_call_chunks=chunks,
        usage_metadata=langchain_usage(usage) if usage is not None else None,
        response_metadata=metadata or {},
        chunk_position="last" if last else None,
    )


def langchain_usage(u: Usage) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=u.prompt_tokens,
        output_tokens=u.generated_tokens,
        total_tokens=u.prompt_tokens + u.generated_tokens,
        input_token_details={"cache_read": u.reused_tokens},
    )


def _loads(arguments: str) -> Any:
    """Arguments' JSON text as a value (None where it is not whole)."""
    try:
        return json.loads(arguments or "{}")
    except ValueError:
        return None


def _openai_call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
