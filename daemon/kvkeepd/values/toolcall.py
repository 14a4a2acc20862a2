"""Tool calls' values: the tools a model may call, which of them a turn must call, the calls a
reply makes and the pieces they stream in.

A leaf like the other values (messages.py puts calls in messages): the byte formats and the
doors name these without the formats, grammars and parsers of kvkeepd.tools. Checks of what a request gives
live here, so every door refuses the same things with the same words.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_GRAMMAR_CHARS, MAX_TOOL_CALLS, MAX_TOOLS

# OpenAI's rule for function names; they are written into the prompt and the output as they
# are, so nothing else may be in them.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# Call ids travel through templates too (Mistral's writes them into the prompt).
_CALL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

#: The families' syntaxes of calls (kvkeepd.tools.formats), and the daemon setting's value
#: that detects one from the chat template.
FormatName = Literal["hermes", "llama3", "mistral", "generic"]
FORMATS: tuple[FormatName, ...] = get_args(FormatName)
AUTO_FORMAT = "auto"

#: What a turn may do with its tools: call them or answer in text (auto), only answer in text
#: (none), call one or more (required), or call the one named (function).
ChoiceMode = Literal["auto", "none", "required", "function"]
CHOICE_MODES: tuple[ChoiceMode, ...] = get_args(ChoiceMode)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its parameters as JSON
    schema text ("" takes any object)."""

    name: str
    description: str = ""
    parameters: str = ""

    def schema(self) -> dict[str, Any]:
        """The parameters' schema as an object (checked by check_tools)."""
        if not self.parameters:
            return {"type": "object"}
        value: dict[str, Any] = json.loads(self.parameters)
        return value


@dataclass(frozen=True)
class ToolChoice:
    """Which calls a turn's reply must make."""

    mode: ChoiceMode = "auto"
    function: str = ""

    @staticmethod
    def of(mode: str, function: str = "") -> ToolChoice:
        """The choice of that mode ("" is auto); InvalidRequest for anything else."""
        for known in CHOICE_MODES:
            if mode == known:
                if (known == "function") != bool(function):
                    raise InvalidRequest(
                        'tool_choice "function" names one function, and only it does', "tool_choice"
                    )
                return ToolChoice(known, function)
        if not mode and not function:
            return ToolChoice()
        raise InvalidRequest(
            f"tool_choice must be one of {', '.join(CHOICE_MODES)}, not {mode[:40]!r}", "tool_choice"
        )

    def calls(self) -> bool:
        """The reply may call a tool."""
        return self.mode != "none"


@dataclass(frozen=True)
class ToolCall:
    """A call a reply made: its id, the function, and the arguments as JSON text."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: the first of each call names its id and function, the
    others carry the next characters of its arguments."""

    index: int
    call_id: str = ""
    name: str = ""
    arguments: str = ""


def check_tools(tools: Sequence[Tool]) -> tuple[Tool, ...]:
    """The tools, checked: at most MAX_TOOLS of them, names of OpenAI's form and each once,
    parameters a JSON object, all their text within MAX_GRAMMAR_CHARS."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    seen: set[str] = set()
    size = 0
    for tool in tools:
        check_name(tool.name)
        if tool.name in seen:
            raise InvalidRequest(f"two tools are named {tool.name!r}", "tools")
        seen.add(tool.name)
        size += len(tool.description) + len(tool.parameters)
        if tool.parameters:
            try:
                schema = json.loads(tool.parameters)
            except (ValueError, RecursionError):
                raise InvalidRequest(f"the parameters of tool {tool.name!r} are not JSON", "tools") from None
            if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                raise InvalidRequest(
                    f"the parameters of tool {tool.name!r} must be a JSON schema of an object"
                )
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(
            f"the tools' descriptions and parameters have {size} characters; "
            f"the limit is {MAX_GRAMMAR_CHARS}",
            "tools",
        )
    return tuple(tools)


def check_name(name: str, field: str = "tools") -> None:
    if not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"a tool's name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, not {name[:70]!r}", field
        )


def check_call_id(call_id: str) -> None:
    if not _CALL_ID.fullmatch(call_id):
        raise InvalidRequest(
            f"a tool call's id must be 1 to 128 of a-z, A-Z, 0-9, _, ., : and -, not {call_id[:130]!r}",
            "messages",
        )


def check_calls(calls: Sequence[ToolCall], *, whole: bool = True) -> None:
    """InvalidRequest unless the calls (of a message given) have ids, names and arguments
    that a template can render: arguments that are JSON are an object. Arguments that are not
    JSON (a reply cut short in the middle of them, which agents send back with an error
    result so that the model tries again) are given to a template as the text they are. With
    `whole` false (the calls of a manifest) the arguments are not looked at."""
    if len(calls) > MAX_TOOL_CALLS:
        raise InvalidRequest(
            f"at most {MAX_TOOL_CALLS} tool calls in a message, got {len(calls)}", "messages"
        )
    for call in calls:
        check_call_id(call.call_id)
        check_name(call.name, "messages")
        if not whole:
            continue
        try:
            arguments = json.loads(call.arguments or "{}")
        except (ValueError, RecursionError):
            continue
        if not isinstance(arguments, dict):
            raise InvalidRequest(
                f"the arguments of the call to {call.name!r} must be a JSON object", "messages"
            )


def choice_for(tools: Sequence[Tool], choice: ToolChoice | None) -> ToolChoice:
    """The choice a turn runs under: as asked (checked against its tools), or by default
    auto with tools and none without (as OpenAI's API has it)."""
    if choice is None:
        return ToolChoice("auto") if tools else ToolChoice("none")
    if choice.mode in ("required", "function") and not tools:
        raise InvalidRequest(f'tool_choice "{choice.mode}" needs tools', "tool_choice")
    if choice.mode == "function" and choice.function not in {t.name for t in tools}:
        raise InvalidRequest(
            f"tool_choice names {choice.function!r}, which is none of the tools", "tool_choice"
        )
    if choice.mode == "auto" and not tools:
        return ToolChoice("none")
    return choice


def join_deltas(calls: Iterable[ToolCall], deltas: Iterable[CallDelta]) -> tuple[ToolCall, ...]:
    """The calls after their streamed pieces: a piece of a new index starts a call, the others
    extend the arguments of theirs."""
    out = list(calls)
    for d in deltas:
        if d.index >= len(out):
            out.append(ToolCall(d.call_id, d.name, d.arguments))
        else:
            old = out[d.index]
            out[d.index] = replace(
                old,
                call_id=old.call_id or d.call_id,
                name=old.name or d.name,
                arguments=old.arguments + d.arguments,
            )
    return tuple(out)
