"""Request bodies of the OpenAI-compatible door, as typed models, and what they mean for the
session layer (messages, a Turn).

Fields kvkeep cannot honour are refused with a 400 that names them, never ignored: a client
that asks for two choices, tools or a JSON schema must not get something else silently.
Fields that change nothing here (`user`, `metadata`, `store`...) are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvkeepd.errors import InvalidRequest
from kvkeepd.limits import MAX_LOGPROBS
from kvkeepd.values import Message, SamplingOverrides, SamplingParams, Turn, check_stop

# The extension value of `session_id` that starts a new session for the caller.
NEW_SESSION = "new"
# OpenAI's legacy completions give 16 tokens unless asked for more.
COMPLETION_MAX_TOKENS = 16
# Roles of OpenAI's chat API and the template role each becomes.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class _Body(BaseModel):
    # strict: "1" is no number and 1 is no boolean; ints are still accepted as floats.
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(_Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[Any] | None = None

    def message(self) -> Message:
        role = ROLES.get(self.role)
        if role is None:
            raise InvalidRequest(
                f"messages of role {self.role[:40]!r} are not supported; roles: {', '.join(ROLES)}"
            )
        if self.tool_calls:
            raise InvalidRequest("tool calls are not supported")
        if self.content is None:
            return Message(role, "")
        if isinstance(self.content, str):
            return Message(role, self.content)
        return Message(role, "".join(p.text for p in self.content))


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationBody(_Body):
    """What chat and legacy completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # Extensions: continue this kvkeep session (or "new": start one) instead of a whole
    # prompt; a session started so may be persistent.
    session_id: str | None = None
    persistent: bool = False

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise InvalidRequest("n must be 1: one choice per request")
        if self.frequency_penalty or self.presence_penalty:
            raise InvalidRequest("frequency_penalty and presence_penalty are not supported")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported")
        if self.persistent and self.session_id != NEW_SESSION:
            raise InvalidRequest(f"persistent goes with session_id {NEW_SESSION!r}: it starts a session")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self) -> SamplingOverrides:
        return SamplingOverrides.of(temperature=self.temperature, top_p=self.top_p, seed=self.seed)

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
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise InvalidRequest("tools and functions are not supported")
        self.json_schema()  # a response_format it cannot take is refused here
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true")

    def chat_messages(self) -> list[Message]:
        return [m.message() for m in self.messages]

    def json_schema(self) -> str:
        """The JSON schema `response_format` asks for ("" for text): OpenAI's `json_schema`
        (its `schema`), or any JSON object for `json_object`."""
        fmt = self.response_format
        kind = fmt.get("type") if fmt is not None else "text"
        if kind == "text":
            return ""
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "json_schema":
            spec = fmt.get("json_schema") if fmt is not None else None
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequest("response_format json_schema needs json_schema.schema, an object")
            return json.dumps(schema)
        raise InvalidRequest(
            f"response_format {str(kind)[:40]!r} is not supported: text, json_object or json_schema"
        )

    def turn(self) -> Turn:
        return self.checked(
            Turn(
                max_tokens=self.max_completion_tokens or self.max_tokens,
                sampling=self.sampling(),
                stop=self.stops(),
                # The engine reports the sampled token's logprob along with the alternatives.
                logprobs=max(1, self.top_logprobs or 0) if self.logprobs else 0,
                json_schema=self.json_schema(),
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
            raise InvalidRequest("echo is not supported")
        if self.suffix:
            raise InvalidRequest("suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of must be 1")

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
            )
        )
