"""A conversation with tools, shaped for a chat template.

Templates of the native families (hermes, llama3, mistral) are given the tools as OpenAI's
API has them (``{"type": "function", "function": {...}}``), an assistant message's calls as
``tool_calls`` with their arguments as an object (what their ``tojson`` expects), and tool
results as messages of role ``tool`` with the id (and the name) of the call they answer; a
message with no calls has no ``tool_calls`` key (some templates test for the key).

A template of the generic format renders no tools, so the conversation is shaped for it into
messages it does render, every added text part of a message's content: the tools are
described at the end of the system prompt (a system message is added if there is none), an
assistant's calls are written after its content in the hermes syntax, and tool results become
one user message per run of them, each result inside ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvkeepd.tools.formats import SYNTAXES
from kvkeepd.values.messages import Message
from kvkeepd.values.toolcall import FormatName, Tool, ToolCall

GENERIC_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions, each "
    "a JSON schema, are within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments within "
    "<tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>\n'
    "The results come back within <tool_response></tool_response> tags."
)


@dataclass(frozen=True)
class Shaped:
    """A message as its template is given it: `name` is the function a tool result answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class TemplateInput:
    """The messages and the tools (None: the template is given none) to render."""

    messages: list[Shaped]
    tools: list[dict[str, Any]] | None = field(default=None)


def shape(fmt: FormatName, messages: Sequence[Message], tools: Sequence[Tool]) -> TemplateInput:
    """The conversation and tools as the template of format `fmt` renders them."""
    names = {c.call_id: c.name for m in messages for c in m.tool_calls}
    if fmt != "generic":
        shaped = [
            Shaped(m.role, m.content, m.tool_calls, m.tool_call_id, names.get(m.tool_call_id, ""))
            for m in messages
        ]
        return TemplateInput(shaped, [openai_tool(t) for t in tools] if tools else None)
    out: list[Shaped] = []
    if tools:
        listing = GENERIC_PROMPT.format(
            tools="\n".join(json.dumps(openai_tool(t), ensure_ascii=False) for t in tools)
        )
        if messages and messages[0].role == "system":
            first = messages[0].content
            out.append(Shaped("system", f"{first}\n\n{listing}" if first else listing))
            messages = messages[1:]
        else:
            out.append(Shaped("system", listing))
    for m in messages:
        if m.role == "tool":
            result = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content.startswith("<tool_response>"):
                out[-1] = Shaped("user", f"{out[-1].content}\n{result}")
            else:
                out.append(Shaped("user", result))
        elif m.tool_calls:
            out.append(Shaped("assistant", written_calls("generic", m.content, m.tool_calls)))
        else:
            out.append(Shaped(m.role, m.content))
    return TemplateInput(out)


def written_calls(fmt: FormatName, content: str, calls: Sequence[ToolCall]) -> str:
    """An assistant's content and calls as the model of format `fmt` writes them (ids aside)."""
    syntax = SYNTAXES[fmt]
    written = syntax.sep.join(
        f"{syntax.call_start}{c.name}{syntax.call_mid}{c.arguments or '{}'}{syntax.call_end}" for c in calls
    )
    calls_text = syntax.trigger + syntax.head + written + syntax.tail
    return f"{content}\n{calls_text}" if content else calls_text


def openai_tool(tool: Tool) -> dict[str, Any]:
    """A tool as OpenAI's API (and the templates trained on it) writes it."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = tool.schema()
    return {"type": "function", "function": function}


def template_message(m: Shaped, content: str) -> dict[str, Any]:
    """`m` as a template's `messages` item, with `content` (a marker) for its content."""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


class WrittenJson(str):
    """Arguments that are not JSON (a reply cut short in the middle of them), which a
    template's `tojson` writes as the model wrote them, not as a JSON string."""


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as an object; arguments that are not JSON keep their text."""
    try:
        return json.loads(call.arguments or "{}")
    except (ValueError, RecursionError):
        return WrittenJson(call.arguments)
