"""The request body of OpenAI's Responses API (`POST /v1/responses`), as a typed model, and
what it means for the session layer: the messages its input items add, a Turn, and whether
it is stored.

Every field OpenAI defines is either honoured, or refused with a 400 that names it when it
asks for something kvkeep does not do (background runs, prompt templates, input that is not
text...); a field OpenAI does not define is refused as OpenAI refuses it ("unknown
parameter"). Fields that cannot change the reply are accepted: `user`, `safety_identifier`,
`service_tier`, `client_metadata`,
`max_tool_calls` (it bounds built-in tools, and there are none), `stream_options`,
`reasoning` (the model does not reason apart from its reply: no reasoning items come out),
`include` values there is nothing for. Function tools in a `namespace` are offered to the
model as `NAMESPACE__NAME` and their calls come back with `name` and `namespace`; hosted tools
the daemon cannot run (web search, file search...) are left out of what the model sees, and
the response says so (ResponseSpec.ignored_tools).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from kvkeepd.api.http.body import ROLES, ClosedBody, salt_bytes
from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_LOGPROBS
from kvkeepd.values.generation import Turn
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides, SamplingParams
from kvkeepd.values.toolcall import Tool, ToolCall, ToolChoice

# Roles of input messages and the template role each becomes.
MESSAGE_ROLES = {role: becomes for role, becomes in ROLES.items() if role != "tool"}
# Content parts that are text, by the roles that send them.
TEXT_PARTS = ("input_text", "output_text")
# What `include` may ask for.
LOGPROBS = "message.output_text.logprobs"
# `include` values of OpenAI's for outputs kvkeep never makes (reasoning items, hosted tools'
# results, images): asked for, there is nothing to include.
NOTHING_TO_INCLUDE = frozenset(
    {
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
# Tools OpenAI runs itself: the daemon cannot, so the model is not shown them.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer_use_preview",
        "mcp",
    }
)
# Between a namespace's name and its function's, in the name the model sees.
NAMESPACE_JOIN = "__"
# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512


class ResponseCreate(ClosedBody):
    """`POST /v1/responses`."""

    model: str
    # Optional with previous_response_id: none continues the stored response.
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    # OpenAI's range.
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: float | None = None
    # An extension: the sampler's seed (the same state and seed give the same reply).
    seed: Annotated[int, Field(ge=0)] | None = None
    # An extension (vLLM's, on its chat completions): the salt of the prompt blocks of the
    # session made for the request, shared by whoever gives the same (body.salt_bytes).
    cache_salt: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    include: list[str] | None = None
    # Names the conversation sent whole (store false) whose kept session continues it, and
    # how long its system prompt is kept durably.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Changes nothing here.
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    client_metadata: dict[str, str] | None = None
    # The model does not reason apart from its reply: asked for, there is none to give.
    reasoning: dict[str, Any] | None = None
    # Refused when they ask for something.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    background_options: Any = None

    def checked(self) -> ResponseSpec:
        """What the request asks for, checked now: before any session is touched."""
        self._refuse_unsupported()
        self._check_metadata()
        sampling = SamplingOverrides.of(temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        sampling.apply(SamplingParams())  # a value no sampler can use is refused here
        logprobs = LOGPROBS in (self.include or ())
        tools, namespaces, ignored = _tools(self.tools or [])
        turn = Turn(
            max_tokens=self.max_output_tokens,
            sampling=sampling,
            logprobs=max(1, self.top_logprobs or 0) if logprobs else 0,
            json_schema=self.json_schema(),
            # A previous response's tools are not carried over (OpenAI's rule): none given, none.
            tools=tools,
            tool_choice=_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            # A stream opens once the prompt's evaluation begins (its first progress report),
            # not at its first token.
            progress=self.stream is True,
        )
        items = input_items(self.input or [])
        return ResponseSpec(
            instructions=self.instructions or None,
            items=items,
            messages=tuple(messages_of(items)),
            turn=turn,
            store=self.store is not False,
            stream=self.stream is True,
            logprobs=logprobs,
            namespaces=namespaces,
            ignored_tools=ignored,
            cache_salt=salt_bytes(self.cache_salt),
        )

    def _refuse_unsupported(self) -> None:
        if self.background:
            raise InvalidRequest(
                "background responses are not supported: stream the response instead", "background"
            )
        refused = {
            "conversation": "conversations are not supported: continue with previous_response_id",
            "prompt": "prompt templates are not supported: give input and instructions",
            "context_management": "context_management is not supported: use truncation",
            "moderation": "moderation is not supported",
            "image": "image options are not supported: the input and output are text",
            "access_programs": "access_programs is not supported",
            "prompt_cache_options": "prompt_cache_options is not supported: what is stored is reused",
            "background_options": "background responses are not supported",
        }
        for name, why in refused.items():
            if getattr(self, name) is not None:
                raise InvalidRequest(why, name)
        for name in self.include or ():
            if name != LOGPROBS and name not in NOTHING_TO_INCLUDE:
                raise InvalidRequest(f"include {name[:80]!r} is not supported: only {LOGPROBS!r}", "include")
        if self.top_logprobs and LOGPROBS not in (self.include or ()):
            raise InvalidRequest(f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
        options = self.stream_options or {}
        if set(options) - {"include_obfuscation"}:
            raise InvalidRequest("stream_options takes include_obfuscation only", "stream_options")

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > METADATA_PAIRS:
            raise InvalidRequest(f"metadata has at most {METADATA_PAIRS} pairs", "metadata")
        for k, v in meta.items():
            if len(k) > METADATA_KEY or len(v) > METADATA_VALUE:
                raise InvalidRequest(
                    f"metadata keys have at most {METADATA_KEY} characters, values {METADATA_VALUE}",
                    "metadata",
                )

    def json_schema(self) -> str:
        """The JSON schema `text.format` asks for ("" for text)."""
        text = self.text or {}
        if set(text) - {"format", "verbosity"}:
            raise InvalidRequest("text takes format and verbosity", "text")
        if text.get("verbosity") not in (None, "medium"):
            raise InvalidRequest("text.verbosity is not supported (the model's own is medium)", "text")
        fmt = text.get("format") or {"type": "text"}
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return ""
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "json_schema":
            assert isinstance(fmt, dict)
            schema = fmt.get("schema")
            if not isinstance(schema, dict):
                raise InvalidRequest("text.format json_schema needs schema, an object", "text")
            if not isinstance(fmt.get("name"), str) or not fmt["name"]:
                raise InvalidRequest("text.format json_schema needs a name", "text")
            return json.dumps(schema)
        raise InvalidRequest(
            f"text.format {str(kind)[:40]!r} is not supported: text, json_object or json_schema", "text"
        )


@dataclass(frozen=True)
class ResponseSpec:
    """A checked request: its input items (as OpenAI lists them, each with an id), the
    messages they add, its turn, and whether it is stored and streamed."""

    instructions: str | None
    items: tuple[dict[str, Any], ...]
    messages: tuple[Message, ...]
    turn: Turn
    store: bool
    stream: bool
    logprobs: bool
    #: The names the model sees for a namespace's functions: (namespace, name) by that name.
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The types of the hosted tools left out of what the model sees.
    ignored_tools: tuple[str, ...] = ()
    #: The cache salt of a session made for it (b"": the tenant's).
    cache_salt: bytes = b""


def input_items(given: str | list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """The input as OpenAI's input items list it (a text is one user message), each with an
    id (the client's, or a new one); InvalidRequest for an item kvkeep cannot take."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return tuple(_item(i, item) for i, item in enumerate(given))


def _item(i: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    where = f"input[{i}]"
    if kind == "message":
        return _message_item(where, item)
    if kind == "function_call":
        _only(where, item, {"type", "call_id", "name", "namespace", "arguments", "id", "status"})
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
        if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidRequest(
                f"{where}: a function_call has a call_id, a name and arguments (text)", "input"
            )
        namespace = item.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidRequest(f"{where}.namespace must be a string", "input")
        listed = {"namespace": namespace} if namespace else {}
        return {
            "id": _id(item.get("id"), "fc_"),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            **listed,
            "arguments": arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        _only(where, item, {"type", "call_id", "output", "id", "status"})
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise InvalidRequest(f"{where}: a function_call_output names its call_id", "input")
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, where + ".output")
        return {
            "id": _id(item.get("id"), "fco_"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": text,
            "status": "completed",
        }
    raise InvalidRequest(f"{where}: items of type {str(kind)[:40]!r} are not supported", "input")


def _message_item(where: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise InvalidRequest(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}", "input")
    _only(where, item, {"type", "role", "content", "id", "status"})
    text = _text(item.get("content"), where + ".content")
    part: dict[str, Any] = {"type": "input_text", "text": text}
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "id": _id(item.get("id"), "msg_"),
        "type": "message",
        "role": role,
        "content": [part],
        "status": "completed",
    }


def _only(where: str, item: dict[str, Any], known: set[str]) -> None:
    extra = set(item) - known
    if extra:
        raise InvalidRequest(f"{where}: unknown parameter {sorted(extra)[0][:40]!r}", "input")


def _text(content: Any, where: str) -> str:
    """Content as text: a string, or parts that are all text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}[{j}]: content of type {str(kind)[:40]!r} is not supported: "
                "input_text or output_text",
                "input",
            )
        out.append(part["text"])
    return "".join(out)


def _id(given: Any, prefix: str) -> str:
    if isinstance(given, str) and 0 < len(given) <= 128:
        return given
    return prefix + secrets.token_hex(12)


def messages_of(items: tuple[dict[str, Any], ...]) -> list[Message]:
    """The messages the input items add to the conversation: an assistant's message and the
    function calls that follow it are one message, as a chat template has them; each call's
    output is a tool message."""
    out: list[Message] = []
    for item in items:
        if item["type"] == "function_call":
            name = NAMESPACE_JOIN.join(filter(None, (item.get("namespace"), item["name"])))
            call = ToolCall(item["call_id"], name, item["arguments"])
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = Message("assistant", last.content, (*last.tool_calls, call))
            else:
                out.append(Message("assistant", "", (call,)))
        elif item["type"] == "function_call_output":
            out.append(Message("tool", item["output"], tool_call_id=item["call_id"]))
        else:
            out.append(Message(MESSAGE_ROLES[item["role"]], "".join(p["text"] for p in item["content"])))
    return out


def _tools(
    given: list[dict[str, Any]],
) -> tuple[tuple[Tool, ...], dict[str, tuple[str, str]], tuple[str, ...]]:
    """The function tools the model is offered, a namespace's under `NAMESPACE__NAME`; those
    names' namespaces and names; and the hosted tools left out."""
    tools: list[Tool] = []
    namespaces: dict[str, tuple[str, str]] = {}
    ignored: list[str] = []
    for i, t in enumerate(given):
        kind = t.get("type")
        if kind in HOSTED_TOOLS:
            ignored.append(str(kind))
        elif kind == "namespace":
            _only(f"tools[{i}]", t, {"type", "name", "description", "tools"})
            space, members = t.get("name"), t.get("tools")
            if not isinstance(space, str) or not isinstance(members, list):
                raise InvalidRequest(f"tools[{i}]: a namespace has a name and tools", "tools")
            for j, member in enumerate(members):
                tool = _tool(f"tools[{i}].tools[{j}]", member)
                name = space + NAMESPACE_JOIN + tool.name
                namespaces[name] = (space, tool.name)
                tools.append(Tool(name, tool.description, tool.parameters))
        else:
            tools.append(_tool(f"tools[{i}]", t))
    return tuple(tools), namespaces, tuple(ignored)


def _tool(where: str, given: Any) -> Tool:
    """A function tool, as the Responses API gives it (flat: name, description, parameters)."""
    if not isinstance(given, dict):
        raise InvalidRequest(f"{where} must be an object", "tools")
    kind = given.get("type")
    if kind != "function":
        raise InvalidRequest(
            f"{where}: tools of type {str(kind)[:40]!r} are not supported: function", "tools"
        )
    _only(where, given, {"type", "name", "description", "parameters", "strict"})
    name, description, parameters = given.get("name"), given.get("description"), given.get("parameters")
    if not isinstance(name, str):
        raise InvalidRequest(f"{where} needs a name", "tools")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.description must be a string", "tools")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.parameters must be a JSON schema (an object)", "tools")
    # `strict` false asks for less than kvkeep gives: every call is held to its parameters.
    return Tool(name, description or "", "" if parameters is None else json.dumps(parameters))


def _choice(given: str | dict[str, Any] | None) -> ToolChoice | None:
    """OpenAI's tool_choice: a mode, or {"type": "function", "name": ...}."""
    if given is None:
        return None
    if isinstance(given, str):
        return ToolChoice.of(given)
    if (
        given.get("type") == "function"
        and set(given) <= {"type", "name"}
        and isinstance(given.get("name"), str)
    ):
        return ToolChoice.of("function", given["name"])
    raise InvalidRequest(
        'tool_choice must be auto, none, required or {"type": "function", "name": ...}', "tool_choice"
    )
