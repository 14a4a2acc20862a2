"""Request bodies of OpenAI's chat completions and completions, as typed models, and what
they mean for the session layer (messages, tools, a Turn).

Fields kvkeep cannot honour are refused with a 400 that names them, never ignored: a client
that asks for two choices, legacy functions or a sampler kvkeep lacks must not get something
else silently. Fields that change nothing here (`user`, `metadata`, `store`...) are ignored.
Besides OpenAI's, llama.cpp's server's extensions that kvkeep has are taken: `grammar`
(GBNF), a top-level `json_schema`, `response_format` `json_object` with a `schema`, `top_k`,
`min_p`, `repeat_penalty` and `return_progress` (streams only); and vLLM's `cache_salt`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from kvkeepd.api.http.body import ROLES, Body, salt_bytes
from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_LOGPROBS
from kvkeepd.values.generation import Turn, check_stop
from kvkeepd.values.messages import Message
from kvkeepd.values.sampling import SamplingOverrides, SamplingParams
from kvkeepd.values.toolcall import Tool, ToolCall, ToolChoice

# The extension value of `session_id` that starts a new session for the caller.
NEW_SESSION = "new"
# OpenAI's legacy completions give 16 tokens unless asked for more.
COMPLETION_MAX_TOKENS = 16
# llama.cpp's sampling extensions kvkeep has no sampler for, and their neutral values: another
# value is refused.
NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "ignore_eos": False, "n_probs": 0, "dry_multiplier": 0.0}


class TextPart(Body):
    type: Literal["text"]
    text: str


class CalledFunction(Body):
    name: str
    arguments: str


class ToolCallIn(Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessageIn(Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: Any = None

    def message(self) -> Message:
        role = ROLES.get(self.role)
        if role is None:
            raise InvalidRequest(
                f"messages of role {self.role[:40]!r} are not supported; roles: {', '.join(ROLES)}",
                "messages",
            )
        if self.function_call is not None:
            raise InvalidRequest(
                "function_call (legacy functions) is not supported: use tool_calls", "messages"
            )
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        content = self.content or ""
        if not isinstance(content, str):
            content = "".join(p.text for p in content)
        return Message(role, content, calls, self.tool_call_id or "")


class FunctionIn(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # every call is held to its parameters anyway


class ToolIn(Body):
    type: Literal["function"]
    function: FunctionIn

    def tool(self) -> Tool:
        f = self.function
        return Tool(f.name, f.description or "", "" if f.parameters is None else json.dumps(f.parameters))


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Body):
    include_usage: bool = False


class GenerationBody(Body):
    """What chat and legacy completions share."""

    # Any name: the daemon serves one model, whatever a client calls it (as llama-server does).
    model: str = ""
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # OpenAI's range.
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Extensions: continue this kvkeep session (or "new": start one) instead of a whole
    # prompt; a session started so may be persistent.
    session_id: str | None = None
    persistent: bool = False
    # vLLM's extension: the salt of the prompt blocks of the session made for the request,
    # shared by whoever gives the same (body.salt_bytes).
    cache_salt: str | None = None
    # llama.cpp's server's extensions (see the module's docstring).
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    return_progress: bool = False
    mirostat: int = 0
    typical_p: float = 1.0
    ignore_eos: bool = False
    n_probs: int = 0
    dry_multiplier: float = 0.0

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise InvalidRequest("n must be 1: one choice per request", "n")
        for name in ("frequency_penalty", "presence_penalty", "logit_bias"):
            if getattr(self, name):
                raise InvalidRequest(f"{name} is not supported", name)
        for name, neutral in NEUTRAL.items():
            if getattr(self, name) != neutral:
                raise InvalidRequest(f"{name} is not supported (only its neutral value, {neutral})", name)
        if self.return_progress and not self.stream:
            # A whole reply has no chunk before its first token to carry the progress in.
            raise InvalidRequest(
                "return_progress needs stream: true (the prompt's progress comes as chunks before "
                "the first token)",
                "return_progress",
            )
        if self.persistent and self.session_id != NEW_SESSION:
            raise InvalidRequest(
                f"persistent goes with session_id {NEW_SESSION!r}: it starts a session", "persistent"
            )
        self.schema_text()  # a response_format it cannot take is refused here
        self.salt()  # and a cache_salt

    def salt(self) -> bytes:
        """The request's cache salt (b"": none)."""
        return salt_bytes(self.cache_salt)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self) -> SamplingOverrides:
        return SamplingOverrides.of(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            top_k=self.top_k,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
        )

    def schema_text(self) -> str:
        """The JSON schema the output is held to ("" for none): `response_format`'s
        (OpenAI's `json_schema`, any object for `json_object`, or llama.cpp's `json_object`
        with a `schema`), or llama.cpp's top-level `json_schema`."""
        fmt = self.response_format
        kind = fmt.get("type") if fmt is not None else "text"
        if self.json_schema is not None:
            if kind != "text":
                raise InvalidRequest("give response_format or json_schema, not both", "json_schema")
            return json.dumps(self.json_schema)
        if kind == "text":
            return ""
        if kind == "json_object":
            schema = fmt.get("schema") if fmt is not None else None
            if schema is not None and not isinstance(schema, dict):
                raise InvalidRequest(
                    "response_format json_object's schema must be an object", "response_format"
                )
            return json.dumps(schema) if schema is not None else '{"type": "object"}'
        if kind == "json_schema":
            spec = fmt.get("json_schema") if fmt is not None else None
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequest(
                    "response_format json_schema needs json_schema.schema, an object", "response_format"
                )
            return json.dumps(schema)
        raise InvalidRequest(
            f"response_format {str(kind)[:40]!r} is not supported: text, json_object or json_schema",
            "response_format",
        )

    def checked(self, turn: Turn) -> Turn:
        """The turn, its sampling values and stop strings checked now: before a session is
        made for it."""
        self.refuse_unsupported()
        turn.sampling.apply(SamplingParams())
        check_stop(turn.stop)
        return turn

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationBody):
    messages: Annotated[list[ChatMessageIn], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    # Refused when they ask for what the model cannot give (they would change the reply).
    modalities: list[str] | None = None
    audio: Any = None
    verbosity: str | None = None
    web_search_options: Any = None
    # A conversation sent whole is continued only in the session the door keeps under it.
    prompt_cache_key: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise InvalidRequest(f"{name} (legacy functions) is not supported: use tools", name)
        if self.modalities not in (None, ["text"]) or self.audio is not None:
            name = "audio" if self.audio is not None else "modalities"
            raise InvalidRequest("the output is text: audio is not supported", name)
        if self.verbosity not in (None, "medium"):
            raise InvalidRequest("verbosity is not supported (the model's own is medium)", "verbosity")
        if self.web_search_options is not None:
            raise InvalidRequest("web search is not supported: nothing here searches", "web_search_options")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")

    def chat_messages(self) -> list[Message]:
        return [m.message() for m in self.messages]

    def chat_tools(self) -> tuple[Tool, ...] | None:
        """The request's tools: a conversation sent whole has these (none if it gives none);
        one continuing a kvkeep session by its id keeps the session's unless it gives some."""
        if self.tools is not None:
            return tuple(t.tool() for t in self.tools)
        return None if self.session_id not in (None, NEW_SESSION) else ()

    def turn(self) -> Turn:
        choice = self.tool_choice
        return self.checked(
            Turn(
                max_tokens=self.max_completion_tokens or self.max_tokens,
                sampling=self.sampling(),
                stop=self.stops(),
                # The engine reports the sampled token's logprob along with the alternatives.
                logprobs=max(1, self.top_logprobs or 0) if self.logprobs else 0,
                grammar=self.grammar or "",
                json_schema=self.schema_text(),
                tools=self.chat_tools(),
                tool_choice=(
                    None
                    if choice is None
                    else ToolChoice("function", choice.function.name)
                    if isinstance(choice, NamedToolChoice)
                    else ToolChoice(choice)
                ),
                parallel_tool_calls=self.parallel_tool_calls is not False,
                progress=self.return_progress,
            )
        )


class CompletionRequest(GenerationBody):
    prompt: str | list[str] | list[int]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of must be 1", "best_of")

    def prompt_parts(self) -> tuple[str, list[int]]:
        """The prompt as text, or as token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p, []
        if p and isinstance(p[0], str):
            if len(p) != 1:
                raise InvalidRequest("one prompt per request")
            return str(p[0]), []
        return "", [int(t) for t in p]

    def turn(self) -> Turn:
        return self.checked(
            Turn(
                max_tokens=self.max_tokens or COMPLETION_MAX_TOKENS,
                sampling=self.sampling(),
                stop=self.stops(),
                logprobs=self.logprobs or 0,
                grammar=self.grammar or "",
                json_schema=self.schema_text(),
                progress=self.return_progress,
            )
        )
