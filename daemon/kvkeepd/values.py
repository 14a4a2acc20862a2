"""The values every layer trades in: messages, sampling parameters, structured-output
specs, generation requests and their chunks, and the names of roles, finish reasons, tiers
and context policies.

A leaf: it imports only the errors, the limits and numpy, so that the byte formats (a
manifest) and the doors can name these values without pulling in jinja2, llguidance or
llama.cpp. Each is a frozen dataclass (a message a session records is the exception: its
list is the session's own) or a `Literal`, whose allowed strings are its tuple here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from kvkeepd.errors import InvalidRequest
from kvkeepd.limits import MAX_GRAMMAR_CHARS, MAX_MESSAGES, MAX_STOP_LENGTH, MAX_STOP_STRINGS
from kvkeepd.toolcall import CallDelta, Tool, ToolCall, ToolChoice, check_call_id, check_calls

# ---- names -----------------------------------------------------------------------------

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = get_args(Role)
#: Why a generation ended: its length limit, the model's end of generation, a stop string,
#: the end of the session's context, a cancel, or the end of a reply that called tools.
FinishReason = Literal["length", "eos", "stop", "context_full", "cancelled", "tool_calls"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)
#: Where a session's state is: in a slot, parked in RAM, or stored (or only its history).
Tier = Literal["hot", "warm", "cold"]
TIERS: tuple[Tier, ...] = get_args(Tier)
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


# ---- messages --------------------------------------------------------------------------


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


def check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    """The stop strings, checked against the limits."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")
    return tuple(stop)


# ---- sampling --------------------------------------------------------------------------

Logits = npt.NDArray[np.float32]

MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """A session's sampling parameters. `seed` is always set once a session exists.

    The one declaration of the sampling fields: the proto writes them out (a format),
    everything else, the manifest included, derives them from this class's fields."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int = 0

    def validate(self) -> SamplingParams:
        """Raise InvalidRequest for any value a sampler cannot use; return self."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidRequest(f"{f.name} must be a finite number, got {value}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 <= self.top_k <= 1_000_000:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repeat_penalty <= 10.0:
            raise InvalidRequest(f"repeat_penalty must be in (0, 10], got {self.repeat_penalty}")
        if self.penalty_last_n < -1:
            raise InvalidRequest(f"penalty_last_n must be >= -1, got {self.penalty_last_n}")
        if not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequest(f"seed must be in [0, 2^64), got {self.seed}")
        return self

    def merged(self, overrides: SamplingOverrides) -> SamplingParams:
        """This value with the overrides' fields replaced, validated."""
        changes = dict(overrides.values)
        return replace(self, **changes).validate() if changes else self  # type: ignore[arg-type]


SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling fields a request or a session creation gives (the others keep their value):
    a subset of SamplingParams' fields, by name (`of` checks them)."""

    values: tuple[tuple[str, float | int], ...] = ()

    @staticmethod
    def of(**given: float | int | None) -> SamplingOverrides:
        """The fields given (None: not given); a name that is no sampling field is a bug."""
        unknown = set(given) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"no sampling fields {sorted(unknown)}")
        return SamplingOverrides(tuple((k, v) for k, v in given.items() if v is not None))

    def get(self, name: str) -> float | int | None:
        return dict(self.values).get(name)

    def apply(self, base: SamplingParams) -> SamplingParams:
        return base.merged(self)

    def without(self, name: str) -> SamplingOverrides:
        return SamplingOverrides(tuple((k, v) for k, v in self.values if k != name))


# ---- structured output -----------------------------------------------------------------

#: A GBNF (or Lark) grammar, a JSON schema, or the Lark grammar of a turn's tool calls
#: (kvkeepd.tools), which may be longer: it holds every tool's parameters.
Kind = Literal["gbnf", "json_schema", "tools"]
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked its output to match."""

    kind: Kind
    text: str

    @staticmethod
    def of(grammar: str, json_schema: str) -> GrammarSpec | None:
        """The spec of a request's `grammar` and `json_schema` fields (None: neither)."""
        if grammar and json_schema:
            raise InvalidRequest("give a grammar or a JSON schema, not both")
        kind: Kind = "gbnf" if grammar else "json_schema"
        text = grammar or json_schema
        if not text:
            return None
        if len(text) > MAX_GRAMMAR_CHARS:
            name = "grammar" if grammar else "JSON schema"
            raise InvalidRequest(f"the {name} has {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")
        return GrammarSpec(kind, text)


@dataclass(frozen=True)
class Constraint:
    """An open constrained output: its grammar, and the history position where it begins.
    A tool-call constraint also keeps what its calls' ids derive from (kvkeepd.tools), so a
    reply continued elsewhere names its calls as the uninterrupted one would."""

    spec: GrammarSpec
    start: int
    call_ids: str = ""


def next_constraint(
    current: Constraint | None, spec: GrammarSpec | None, start: int, continuing: bool
) -> Constraint | None:
    """The constraint a request runs under. `start` is where its output begins; `continuing`:
    the request adds no prompt. Such a request continues the open constraint when it gives
    no grammar or the same one; anything else starts `spec` afresh (or runs unconstrained)."""
    if continuing and current is not None and spec in (None, current.spec):
        return current
    return Constraint(spec, start) if spec is not None else None


# ---- generation ------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """What every generation request says besides its prompt."""

    max_tokens: int | None = None
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    stop: Sequence[str] = ()
    logprobs: int = 0
    # Structured output: a GBNF grammar or a JSON schema (text), at most one of them.
    grammar: str = ""
    json_schema: str = ""
    # Chat turns: the tools the session keeps from now on (None: those it has), which of them
    # the reply must call (None: auto with tools, none without), and whether it may call
    # several.
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # Report the prompt's evaluation as it goes (chunks carrying a PromptProgress).
    progress: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request to extend a session by `prompt` and generate."""

    prompt: tuple[int, ...]
    max_tokens: int | None
    params: SamplingParams
    stop: tuple[str, ...]
    logprobs: int = 0
    # Where a reply stops when max_tokens says nothing (the daemon's --default-max-tokens;
    # None: at the end of the context). Unlike max_tokens, no room is kept for it.
    default_max_tokens: int | None = None
    # Chunks of PromptProgress while the prompt is evaluated.
    progress: bool = False


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0
    evaluated_tokens: int = 0
    # The history the generation followed (earlier turns and this prompt), in tokens.
    context_tokens: int = 0
    # Tokens of earlier turns dropped to make room (the "truncate" context policy).
    dropped_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class GeneratedToken:
    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class PromptProgress:
    """How far a generation's prompt is evaluated: of `total` tokens (the session's history
    and the prompt), `cached` were computed when the evaluation began and `processed` are now
    (the cached ones included), `time_ms` after it began."""

    total: int
    cached: int
    processed: int
    time_ms: float


@dataclass(frozen=True)
class Chunk:
    """One piece of a streamed generation; the last carries finish_reason and usage. A chunk
    with `progress` (asked for by the request) carries nothing else."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[GeneratedToken, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    tool_calls: tuple[CallDelta, ...] = ()
    progress: PromptProgress | None = None
