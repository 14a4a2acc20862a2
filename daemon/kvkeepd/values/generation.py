"""Generations: what a request says besides its prompt, a validated request, and what it
streams back (chunks, usage, logprobs, progress, finish reasons)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from kvkeepd.errors import InvalidRequest
from kvkeepd.request_limits import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from kvkeepd.values.sampling import SamplingOverrides, SamplingParams
from kvkeepd.values.toolcall import CallDelta, Tool, ToolChoice

#: Why a generation ended: its length limit, the model's end of generation, a stop string,
#: the end of the session's context, a cancel, or the end of a reply that called tools.
FinishReason = Literal["length", "eos", "stop", "context_full", "cancelled", "tool_calls"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)


def check_stop(stop: Sequence[str]) -> tuple[str, ...]:
    """The stop strings, checked against the limits."""
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for s in stop:
        if not s or len(s) > MAX_STOP_LENGTH:
            raise InvalidRequest(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")
    return tuple(stop)


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
    """What one request cost, in tokens, as OpenAI counts them: the prompt is the whole
    context the reply followed (earlier turns and this request's), `reused_tokens` of it were
    computed already and `evaluated_tokens` ran through the model (a finished request's
    prompt is their sum)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    reused_tokens: int = 0
    evaluated_tokens: int = 0
    # Tokens this request added to the session before its reply (the prompt's new part).
    added_tokens: int = 0
    # Every token the request ran through the model: the prompt's evaluated ones and the
    # generated ones fed back (the daemon's tally counts these as evaluated).
    decoded_tokens: int = 0
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
    # The stop string that ended the reply, of those given (finish_reason "stop").
    stop_sequence: str = ""
