"""The request bodies of Anthropic's Messages API (`POST /v1/messages` and its
`count_tokens`), as typed models, and what they mean for the session layer: the conversation
as messages, its tools, and a Turn.

Anthropic's content blocks become the template's messages: a user's text blocks one user
message (joined by a blank line), its `tool_result` blocks a tool message each (an `is_error`
result's text begins with "Error: ", since templates have no field for it), an assistant's
text and `tool_use` blocks one assistant message with its calls, a system message among the
others (Claude Code sends its environment so) a system message where it stands. `thinking` blocks and the
`thinking` option are accepted and dropped: the served model has no separate reasoning to
show or to hide. `output_config.format` (structured outputs) holds the reply's text to its
JSON schema, as the OpenAI doors' `response_format` does. Images and documents are refused:
the model has no vision. What would change the reply and cannot be honoured (an assistant's
message last, to be continued; server tools; MCP servers) is refused with a 400 that names it.
One extension is taken: `cache_salt` (vLLM's name), the salt of the conversation's cached
prompt, so that tenants giving the same salt share its breakpoints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from kvkeepd.api.http.body import Body, salt_bytes
from kvkeepd.errors import InvalidRequest
from kvkeepd.values.generation import Turn, check_stop
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides, SamplingParams
from kvkeepd.values.toolcall import Tool, ToolCall, ToolChoice

#: How a resent call's arguments are written back: the text the model wrote for the call of
#: that id, when its JSON is the call's `input` (so the conversation matches the session's
#: history exactly); None to write the input as JSON.
Recall = Callable[[str, dict[str, Any]], str | None]
#: A cache breakpoint's time to live in seconds, by its `ttl` (none: 5 minutes).
TTLS = {"5m": 300.0, "1h": 3600.0}
#: The cache breakpoints one request may mark, as Anthropic allows.
MAX_BREAKPOINTS = 4
# Choices of Anthropic's `tool_choice` and the mode each is here.
CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


class CacheControl(Body):
    """A cache breakpoint: the conversation up to its block is kept for `ttl`."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    def seconds(self) -> float:
        return TTLS[self.ttl or "5m"]


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class MediaBlock(Body):
    """An image or a document: refused, the served model has no vision."""

    type: Literal["image", "document"]
    cache_control: CacheControl | None = None


class ThinkingBlock(Body):
    """An earlier reply's reasoning (another model's): dropped."""

    type: Literal["thinking", "redacted_thinking"]
    cache_control: CacheControl | None = None


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def marks(self) -> list[CacheControl]:
        """Its cache breakpoints: its own and its content blocks'."""
        inner = [] if isinstance(self.content, str) else [b.cache_control for b in self.content]
        return [m for m in (self.cache_control, *inner) if m is not None]

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else _joined([_text_of(b) for b in self.content])
        return f"Error: {text}" if self.is_error else text


Block = Annotated[
    TextBlock | MediaBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class MessageIn(Body):
    # Claude Code sends its environment as a system message among the others, after the user's.
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    def marks(self) -> list[tuple[int, CacheControl]]:
        """Its cache breakpoints, each with how many of its template messages (`messages`)
        end at or before the marked block: a `tool_result` block's mark (or one on a block
        of its content) ends after its tool message, any other block's after the whole
        message."""
        if isinstance(self.content, str):
            return []
        whole = len(self.messages(lambda _id, _input: ""))
        out: list[tuple[int, CacheControl]] = []
        results = 0
        for block in self.content:
            if isinstance(block, ToolResultBlock):
                results += 1
                out += [(results if self.role == "user" else whole, m) for m in block.marks()]
            elif block.cache_control is not None:
                out.append((whole, block.cache_control))
        return out

    def messages(self, recall: Recall) -> list[Message]:
        """This message as the template's: tool results first (Anthropic puts them first
        in their message), then the text, with an assistant's calls."""
        if isinstance(self.content, str):
            return [Message(self.role, self.content)]
        texts: list[str] = []
        calls: list[ToolCall] = []
        results: list[Message] = []
        for block in self.content:
            if isinstance(block, TextBlock | MediaBlock):
                texts.append(_text_of(block))
            elif isinstance(block, ToolUseBlock):
                if self.role != "assistant":
                    raise InvalidRequest("tool_use blocks are the assistant's", "messages")
                arguments = recall(block.id, block.input) or json.dumps(block.input, ensure_ascii=False)
                calls.append(ToolCall(block.id, block.name, arguments))
            elif isinstance(block, ToolResultBlock):
                if self.role != "user":
                    raise InvalidRequest("tool_result blocks are the user's", "messages")
                results.append(Message("tool", block.text(), tool_call_id=block.tool_use_id))
        text = _joined(texts)
        if self.role == "system":
            return [Message("system", text)] if text else []
        if self.role == "assistant":
            return [Message("assistant", text, tuple(calls))] if text or calls else []
        return [*results, Message("user", text)] if text or not results else results


class ToolIn(Body):
    name: str
    description: str = ""
    input_schema: dict[str, Any]
    # Anthropic's own tools (bash, web search, a text editor...) name a versioned type.
    type: str | None = None
    cache_control: CacheControl | None = None

    def tool(self) -> Tool:
        if self.type not in (None, "custom"):
            raise InvalidRequest(
                f"tool type {self.type[:60]!r} is not supported: only custom tools (with an input_schema)",
                "tools",
            )
        return Tool(self.name, self.description, json.dumps(self.input_schema))


class ToolChoiceIn(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def choice(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise InvalidRequest('tool_choice "tool" names one tool, and only it does', "tool_choice")
        return ToolChoice.of(CHOICES[self.type], self.name or "")


class ConversationBody(Body):
    """What a message and a count of its tokens share: the conversation and its tools."""

    # Any name: the daemon serves one model, whatever a client calls it.
    model: str = ""
    messages: Annotated[list[MessageIn], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    # Extended thinking: the served model has no separate reasoning (the module's docstring).
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None

    def conversation(self, recall: Recall) -> list[Message]:
        """The whole conversation as the template's messages, its system prompt first."""
        if (found := len(self._heads()) + sum(len(m.marks()) for m in self.messages)) > MAX_BREAKPOINTS:
            raise InvalidRequest(
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {found}.",
                "cache_control",
            )
        if self.mcp_servers:
            raise InvalidRequest(
                "mcp_servers is not supported: the daemon calls no tools itself", "mcp_servers"
            )
        if [m.role for m in self.messages if m.role != "system"][-1:] != ["user"]:
            raise InvalidRequest(
                "the last message must be the user's: continuing an assistant's message is not supported",
                "messages",
            )
        system = self.system if isinstance(self.system, str) else _joined([b.text for b in self.system or ()])
        out = [Message("system", system)] if system else []
        for m in self.messages:
            out += m.messages(recall)
        return out

    def chat_tools(self) -> tuple[Tool, ...]:
        return tuple(t.tool() for t in self.tools or ())

    def breakpoints(self, conversation: list[Message]) -> list[tuple[list[Message], float]]:
        """The prefixes of the conversation (as `conversation` gave it) that the client
        marked for caching, each with its time to live. The template renders whole messages:
        a mark on the system prompt or on a tool ends after the system message, a mark on a
        `tool_result` block after its tool message, and a mark on any other block of a
        message after that message."""
        n = 1 if conversation and conversation[0].role == "system" else 0
        marks = [(n, m) for m in self._heads()]
        for m in self.messages:
            marks += [(n + end, mark) for end, mark in m.marks()]
            n += len(m.messages(lambda _id, _input: ""))
        return [(conversation[:end], mark.seconds()) for end, mark in marks if end]

    def _heads(self) -> list[CacheControl]:
        """The breakpoints on the system prompt's blocks and on the tools."""
        blocks = [] if isinstance(self.system, str) else self.system or []
        heads = [b.cache_control for b in blocks] + [t.cache_control for t in self.tools or ()]
        return [m for m in heads if m is not None]


class OutputFormat(Body):
    """Structured outputs: the reply's text is JSON that `schema` allows."""

    type: Literal["json_schema"]
    json_schema: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(Body):
    format: OutputFormat | None = None
    # How much effort the model puts in: the served model has one way of answering.
    effort: str | None = None


class MessagesRequest(ConversationBody):
    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    # Anthropic's end-user id and service tier change nothing in a reply.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None
    # An extension: the salt of the prompt blocks and breakpoints of the session made for the
    # request, shared by whoever gives the same (body.salt_bytes).
    cache_salt: str | None = None

    def salt(self) -> bytes:
        """The request's cache salt (b"": none)."""
        return salt_bytes(self.cache_salt)

    def turn(self) -> Turn:
        """The turn, its sampling values and stop strings checked now: before a session is
        made for it. Streams report the prompt's progress, whose first report says what of
        the prompt was cached before anything else is sent (`message_start`'s usage)."""
        choice = self.tool_choice
        turn = Turn(
            max_tokens=self.max_tokens,
            sampling=SamplingOverrides.of(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
            stop=list(self.stop_sequences or ()),
            json_schema=self._schema_text(),
            tools=self.chat_tools(),
            tool_choice=choice.choice() if choice is not None else None,
            parallel_tool_calls=choice is None or not choice.disable_parallel_tool_use,
            progress=self.stream,
        )
        turn.sampling.apply(SamplingParams())
        check_stop(turn.stop)
        return turn

    def _schema_text(self) -> str:
        """The JSON schema `output_config.format` holds the reply's text to ("": none); a
        schema that cannot be compiled is refused when the turn's grammar is."""
        fmt = self.output_config.format if self.output_config is not None else None
        return json.dumps(fmt.json_schema) if fmt is not None else ""


def _text_of(block: TextBlock | MediaBlock) -> str:
    if isinstance(block, MediaBlock):
        raise InvalidRequest(
            f"{block.type} blocks are not supported: the served model has no vision", "messages"
        )
    return block.text


def _joined(texts: list[str]) -> str:
    return "\n\n".join(t for t in texts if t)
