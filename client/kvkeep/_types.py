"""The values the client takes and returns: frozen dataclasses, free of protobuf.

String fields that name one of a few cases use lower-case words:

- roles: ``"system"``, ``"user"``, ``"assistant"``, ``"tool"`` (a tool's result)
- residency: ``"hot"`` (in an engine slot), ``"warm"`` (in RAM), ``"cold"`` (on disk)
- finish reasons: ``"length"``, ``"eos"``, ``"stop"``, ``"context_full"``, ``"cancelled"``,
  ``"tool_calls"`` (the reply called tools)
- tool choices: ``"auto"`` (text or calls), ``"none"`` (text only), ``"required"`` (one call
  or more), or a tool (or a tool's name) to call once

Timestamps are unix seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How tokens are drawn; a field left None takes the session's or the daemon's value."""

    temperature: float | None = None
    """0 samples greedily."""
    top_k: int | None = None
    """0 turns it off."""
    top_p: float | None = None
    """1 turns it off."""
    min_p: float | None = None
    """0 turns it off."""
    repeat_penalty: float | None = None
    """1 turns it off."""
    penalty_last_n: int | None = None
    """How many recent tokens the penalty looks at; -1 for the whole history."""
    seed: int | None = None
    """Unset: the daemon picks one and records it in the session."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call: its name (1 to 64 of a-z, A-Z, 0-9, _ and -), what it
    does, and its parameters as a JSON schema of an object (None: any object)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call a reply made: its id, the tool, and the arguments as JSON text."""

    call_id: str
    name: str
    arguments: str

    def args(self) -> dict[str, Any]:
        """The arguments as an object (a reply cut short in the middle of them: ValueError)."""
        value = json.loads(self.arguments or "{}")
        if not isinstance(value, dict):
            raise ValueError("the arguments are not a JSON object")
        return value


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call: a call's first piece names its id and tool, the others
    carry the next characters of its arguments."""

    index: int
    call_id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a session's conversation: an assistant's may carry the calls it made,
    a tool's result (role ``"tool"``) names the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """What one generation request cost, in tokens, as OpenAI counts them: the prompt is the
    whole context the reply followed (the session's earlier turns and this request's), of
    which ``reused_tokens`` were computed already and ``evaluated_tokens`` ran through the
    model. For a request that finished, ``prompt_tokens == reused_tokens + evaluated_tokens``
    (one cancelled during its prompt evaluated less)."""

    prompt_tokens: int
    """The whole prompt the reply followed, in tokens (OpenAI's ``prompt_tokens``)."""
    generated_tokens: int
    reused_tokens: int
    """Of the prompt, tokens already computed that the request did not evaluate again
    (OpenAI's ``cached_tokens``)."""
    evaluated_tokens: int
    """Of the prompt, tokens the request ran through the model."""
    dropped_tokens: int = 0
    """Tokens of earlier turns dropped to make room (context policy ``"truncate"``)."""
    added_tokens: int = 0
    """Of the prompt, tokens the request added to the session (its new part)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token and its log-probability."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class GeneratedToken:
    """A sampled token with the most likely alternatives at its position."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One piece of a streamed generation; only the last has a finish_reason and usage."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[GeneratedToken, ...]
    finish_reason: str | None
    usage: Usage | None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    """Pieces of the reply's calls (``text`` holds its content only)."""


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """How far the daemon is in evaluating a request's prompt, reported to ``on_progress``
    before the first token: of ``total`` tokens (the session's history and the new prompt),
    ``cached`` were computed already when it began, and ``processed`` are now (the cached ones
    included), ``elapsed`` seconds after it began."""

    total: int
    cached: int
    processed: int
    elapsed: float

    @property
    def fraction(self) -> float:
        """The part of the prompt evaluated, from 0 to 1 (1 for an empty one)."""
        return self.processed / self.total if self.total else 1.0

    @property
    def evaluated(self) -> int:
        """The tokens this request evaluated so far (the cached ones not counted)."""
        return self.processed - self.cached


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation: the chunks of a stream joined."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    logprobs: tuple[GeneratedToken, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the reply made (``text`` is its content without them)."""


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A session's state as the daemon reports it."""

    session_id: str
    persistent: bool
    n_tokens: int
    n_ctx: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    messages: tuple[Message, ...]
    residency: str
    created_at: float
    last_used_at: float
    n_checkpoints: int
    head_checkpoint_id: str | None
    context_policy: str = "error"
    """What a chat turn that does not fit does: ``"error"`` or ``"truncate"``."""
    truncations: int = 0
    """Turns that dropped earlier turns to fit."""
    dropped_tokens: int = 0
    """Tokens those turns dropped, in all."""
    holder: str = ""
    """With daemons sharing a catalog: the daemon that holds the session (its name), or
    ``""`` while none does."""
    tools: tuple[Tool, ...] = ()
    """The tools its chat turns may call."""
    location: str = ""
    """Where its state is now: ``"slot N"`` (an engine slot), ``"dock"`` (device memory beside
    the slots), ``"ram"``, ``"disk"``, ``"shared store"`` (a remote block store) or
    ``"history only"`` (its next turn evaluates its tokens again)."""
    expires_at: float = 0.0
    """When it expires idle at the earliest (unix seconds; the daemon's --idle-ttl or
    --persistent-ttl after its last use), ``0`` for never."""
    forked_from: str = ""
    """The session or checkpoint it was forked from, or ``""``."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A saved session state."""

    checkpoint_id: str
    session_id: str
    label: str | None
    n_tokens: int
    bytes_written: int
    """Bytes this checkpoint added to the store."""
    bytes_referenced: int
    """Bytes of all the blocks it references, shared ones included."""
    created_at: float


@dataclass(frozen=True, slots=True)
class ResponseInfo:
    """A stored response of the HTTP door's ``/v1/responses``, as a listing reports it."""

    response_id: str
    previous_response_id: str
    """The response it continues; ``""``: none."""
    created_at: float
    n_tokens: int
    """Tokens of the conversation's state it holds."""
    bytes_written: int
    """Bytes its save added to the store."""
    bytes_referenced: int
    """Bytes of all the blocks it references, shared ones included."""
    expires_at: float
    """When the daemon's ``--response-ttl`` deletes it at the earliest; 0: never."""


@dataclass(frozen=True, slots=True)
class ResponsePage:
    """A page of stored responses, and whether more follow it (ask again with ``after`` the
    last one's id)."""

    responses: tuple[ResponseInfo, ...]
    has_more: bool


@dataclass(frozen=True, slots=True)
class Info:
    """What the daemon runs: its model, engine mode, limits and counters."""

    version: str
    model_path: str
    model_fingerprint: str
    model_description: str
    n_vocab: int
    n_ctx_train: int
    slots: int
    ctx_per_session: int
    kv_type: str
    mode: str
    """``"exact"`` or ``"compact"``."""
    has_chat_template: bool
    slots_in_use: int
    sessions: int
    sessions_hot: int
    sessions_warm: int
    sessions_cold: int
    swap_ins: int
    swap_in_seconds_total: float
    tokens_reused: int
    tokens_evaluated: int
    tokens_generated: int
    max_prompt_tokens: int
    block_tokens: int
    architecture: str
    memory_type: str
    """The model's memory: ``"kv"``, ``"iswa"`` (full + sliding-window attention),
    ``"hybrid"``, ``"hybrid-iswa"``, ``"recurrent"`` or ``"unknown"``."""
    checkpoints_carry_state: bool
    """False: checkpoints keep only the token history, evaluated again on restore."""
    state_note: str
    backend: str = ""
    """What runs the model: the build's GPU backend (``"CUDA"``, ``"Metal"``...), else ``"CPU"``."""
    device: str = ""
    """The device(s) that run it, as ``NAME: DESCRIPTION``."""
    device_memory_total: int = 0
    device_memory_free: int = 0
    """Bytes free on those devices once the model and the KV cache were allocated."""
    gpu_layers: int = 0
    """Layers asked to be offloaded to the GPU (-1: all)."""
    docks: int = 0
    """KV streams beside the slots that keep idle sessions in device memory (--gpu-kv-budget)."""
    sessions_docked: int = 0
    kv_stream_bytes: int = 0
    """Bytes of KV that one slot or dock holds."""
    pinned_transfers: bool = False
    """Host states reach the device through pinned (page-locked) memory."""
    mode_note: str = ""
    """Why the mode is not exact: the start-up probe's finding, or the settings; empty when exact."""
    flash_attention: bool = False
    """Flash attention is on: compact mode's, or exact mode's batch-invariant kernels."""
    attention_note: str = ""
    """Why exact mode evaluates without flash attention where it was to try it (the start-up
    probe found its kernels depend on the batch here); empty otherwise."""
    tool_format: str = ""
    """How the model writes tool calls: ``"hermes"``, ``"llama3"``, ``"mistral"`` or
    ``"generic"`` (its template renders no tools: the daemon writes them into the system
    prompt); ``""`` without a chat template."""
    http_address: str = ""
    """Where the OpenAI-compatible HTTP door listens (``host:port``, its API under ``/v1``);
    ``""``: it is off."""
    metrics_address: str = ""
    """Where Prometheus metrics are served (``host:port``, ``/metrics``); ``""``: off."""
    response_ttl_seconds: float = 0.0
    """Seconds a stored response (the HTTP door's ``/v1/responses``) is kept; 0: until deleted."""
