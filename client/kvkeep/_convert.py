"""Conversions between the protobuf messages and the public types, and request builders."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from kvkeep._errors import InternalError
from kvkeep._types import (
    CheckpointInfo,
    Chunk,
    Completion,
    GeneratedToken,
    Info,
    Message,
    ResponseInfo,
    ResponsePage,
    SamplingParams,
    SessionInfo,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from kvkeep.v1 import kvkeep_pb2 as pb

_ROLES: dict[pb.Role.ValueType, str] = {
    pb.ROLE_SYSTEM: "system",
    pb.ROLE_USER: "user",
    pb.ROLE_ASSISTANT: "assistant",
    pb.ROLE_TOOL: "tool",
}
_RESIDENCIES: dict[pb.Residency.ValueType, str] = {
    pb.RESIDENCY_HOT: "hot",
    pb.RESIDENCY_WARM: "warm",
    pb.RESIDENCY_COLD: "cold",
}
_FINISH_REASONS: dict[pb.FinishReason.ValueType, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_CONTEXT_FULL: "context_full",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_ROLE_VALUES = {v: k for k, v in _ROLES.items()}
_RESIDENCY_VALUES = {v: k for k, v in _RESIDENCIES.items()}
_FINISH_REASON_VALUES = {v: k for k, v in _FINISH_REASONS.items()}
_UNSPECIFIED = "unspecified"


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 as ``x``."""
    # Sampling floats travel as float32, so a temperature of 0.7 would come back as
    # 0.699999988, a number nobody typed.
    packed = struct.pack("<f", x)
    for digits in range(6, 10):
        shorter = float(f"{x:.{digits}g}")
        if struct.pack("<f", shorter) == packed:
            return shorter
    return x


def _strings(values: Sequence[str]) -> list[str]:
    # A lone string is a Sequence[str] too; without this, "\n" would stop on each character.
    return [values] if isinstance(values, str) else list(values)


def sampling_to_pb(p: SamplingParams | None) -> pb.SamplingParams | None:
    """The message for ``p``; None stays None so the field remains unset."""
    if p is None:
        return None
    # protobuf leaves a field unset when its keyword argument is None.
    return pb.SamplingParams(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """The parameters set in ``m``; unset fields become None."""

    def value(name: str) -> float | int | None:
        if not m.HasField(name):  # type: ignore[arg-type]
            return None
        v: float | int = getattr(m, name)
        return _f32(v) if isinstance(v, float) else v

    return SamplingParams(**{f.name: value(f.name) for f in dataclasses.fields(SamplingParams)})  # type: ignore[arg-type]


def message_to_pb(msg: Message) -> pb.Message:
    """The message for one message of a conversation."""
    return pb.Message(
        role=_ROLE_VALUES.get(msg.role, pb.ROLE_UNSPECIFIED),
        content=msg.content,
        tool_calls=[call_to_pb(c) for c in msg.tool_calls],
        tool_call_id=msg.tool_call_id or "",
    )


def message_from_pb(m: pb.Message) -> Message:
    """One message of a conversation."""
    return Message(
        role=_ROLES.get(m.role, _UNSPECIFIED),
        content=m.content,
        tool_calls=tuple(call_from_pb(c) for c in m.tool_calls),
        tool_call_id=m.tool_call_id or None,
    )


def tool_to_pb(t: Tool) -> pb.Tool:
    """The message for a tool."""
    if not isinstance(t, Tool):
        raise TypeError(f"tools are kvkeep.Tool values, not {type(t).__name__}")
    parameters = "" if t.parameters is None else json.dumps(t.parameters)
    return pb.Tool(name=t.name, description=t.description, parameters=parameters)


def tool_from_pb(m: pb.Tool) -> Tool:
    """A tool."""
    return Tool(
        name=m.name, description=m.description, parameters=json.loads(m.parameters) if m.parameters else None
    )


def call_to_pb(c: ToolCall) -> pb.ToolCall:
    """The message for a call a reply made."""
    return pb.ToolCall(call_id=c.call_id, name=c.name, arguments=c.arguments)


def call_from_pb(m: pb.ToolCall) -> ToolCall:
    """A call a reply made."""
    return ToolCall(call_id=m.call_id, name=m.name, arguments=m.arguments)


def tool_choice_to_pb(choice: str | Tool) -> pb.ToolChoice:
    """The message for a tool choice: a mode, or the tool (its name) to call."""
    if isinstance(choice, Tool):
        return pb.ToolChoice(mode="function", function=choice.name)
    if choice in ("auto", "none", "required"):
        return pb.ToolChoice(mode=choice)
    return pb.ToolChoice(mode="function", function=choice)


def join_calls(calls: Iterable[ToolCall], deltas: Iterable[ToolCallDelta]) -> tuple[ToolCall, ...]:
    """The calls after their streamed pieces."""
    out = list(calls)
    for d in deltas:
        if d.index >= len(out):
            out.append(ToolCall(d.call_id, d.name, d.arguments))
        else:
            c = out[d.index]
            out[d.index] = ToolCall(c.call_id or d.call_id, c.name or d.name, c.arguments + d.arguments)
    return tuple(out)


def usage_to_pb(u: Usage) -> pb.Usage:
    """The message for a request's token counts."""
    return pb.Usage(
        prompt_tokens=u.prompt_tokens,
        generated_tokens=u.generated_tokens,
        reused_tokens=u.reused_tokens,
        evaluated_tokens=u.evaluated_tokens,
        dropped_tokens=u.dropped_tokens,
        added_tokens=u.added_tokens,
    )


def usage_from_pb(m: pb.Usage) -> Usage:
    """A request's token counts."""
    return Usage(
        prompt_tokens=m.prompt_tokens,
        generated_tokens=m.generated_tokens,
        reused_tokens=m.reused_tokens,
        evaluated_tokens=m.evaluated_tokens,
        dropped_tokens=m.dropped_tokens,
        added_tokens=m.added_tokens,
    )


def token_logprob_to_pb(t: TokenLogprob) -> pb.TokenLogprob:
    """The message for a token and its log-probability."""
    return pb.TokenLogprob(token_id=t.token_id, text=t.text, logprob=t.logprob)


def token_logprob_from_pb(m: pb.TokenLogprob) -> TokenLogprob:
    """A token and its log-probability."""
    return TokenLogprob(token_id=m.token_id, text=m.text, logprob=m.logprob)


def generated_token_to_pb(g: GeneratedToken) -> pb.GeneratedToken:
    """The message for a sampled token and its alternatives."""
    return pb.GeneratedToken(
        sampled=token_logprob_to_pb(g.sampled), top=[token_logprob_to_pb(t) for t in g.top]
    )


def generated_token_from_pb(m: pb.GeneratedToken) -> GeneratedToken:
    """A sampled token and its alternatives."""
    return GeneratedToken(
        sampled=token_logprob_from_pb(m.sampled),
        top=tuple(token_logprob_from_pb(t) for t in m.top),
    )


def chunk_to_pb(c: Chunk) -> pb.GenerationChunk:
    """The message for one piece of a generation."""
    reason = pb.FINISH_REASON_UNSPECIFIED
    if c.finish_reason is not None:
        reason = _FINISH_REASON_VALUES.get(c.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    return pb.GenerationChunk(
        text=c.text,
        token_ids=c.token_ids,
        logprobs=[generated_token_to_pb(g) for g in c.logprobs],
        finish_reason=reason,
        usage=usage_to_pb(c.usage) if c.usage is not None else None,
        tool_calls=[
            pb.ToolCallDelta(index=d.index, call_id=d.call_id, name=d.name, arguments=d.arguments)
            for d in c.tool_calls
        ],
    )


def chunk_from_pb(m: pb.GenerationChunk) -> Chunk:
    """One piece of a generation."""
    return Chunk(
        text=m.text,
        token_ids=tuple(m.token_ids),
        logprobs=tuple(generated_token_from_pb(g) for g in m.logprobs),
        finish_reason=_FINISH_REASONS.get(m.finish_reason),
        usage=usage_from_pb(m.usage) if m.HasField("usage") else None,
        tool_calls=tuple(ToolCallDelta(d.index, d.call_id, d.name, d.arguments) for d in m.tool_calls),
    )


def join_chunks(chunks: Iterable[Chunk]) -> Completion:
    """The whole generation that ``chunks`` stream."""
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[GeneratedToken] = []
    deltas: list[ToolCallDelta] = []
    last: Chunk | None = None
    for last in chunks:
        text.append(last.text)
        token_ids.extend(last.token_ids)
        logprobs.extend(last.logprobs)
        deltas.extend(last.tool_calls)
    if last is None or last.finish_reason is None or last.usage is None:
        raise InternalError("the generation stream ended without its final chunk")
    return Completion(
        text="".join(text),
        token_ids=tuple(token_ids),
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=tuple(logprobs),
        tool_calls=join_calls((), deltas),
    )


def session_info_to_pb(s: SessionInfo) -> pb.SessionInfo:
    """The message for a session's state."""
    return pb.SessionInfo(
        session_id=s.session_id,
        persistent=s.persistent,
        n_tokens=s.n_tokens,
        n_ctx=s.n_ctx,
        sampling=sampling_to_pb(s.sampling),
        stop=s.stop,
        messages=[message_to_pb(m) for m in s.messages],
        residency=_RESIDENCY_VALUES.get(s.residency, pb.RESIDENCY_UNSPECIFIED),
        created_at=s.created_at,
        last_used_at=s.last_used_at,
        n_checkpoints=s.n_checkpoints,
        head_checkpoint_id=s.head_checkpoint_id or "",
        context_policy=s.context_policy,
        truncations=s.truncations,
        dropped_tokens=s.dropped_tokens,
        holder=s.holder,
        tools=[tool_to_pb(t) for t in s.tools],
        location=s.location,
        expires_at=s.expires_at,
        forked_from=s.forked_from,
    )


def session_info_from_pb(m: pb.SessionInfo) -> SessionInfo:
    """A session's state."""
    return SessionInfo(
        session_id=m.session_id,
        persistent=m.persistent,
        n_tokens=m.n_tokens,
        n_ctx=m.n_ctx,
        sampling=sampling_from_pb(m.sampling),
        stop=tuple(m.stop),
        messages=tuple(message_from_pb(x) for x in m.messages),
        residency=_RESIDENCIES.get(m.residency, _UNSPECIFIED),
        created_at=m.created_at,
        last_used_at=m.last_used_at,
        n_checkpoints=m.n_checkpoints,
        head_checkpoint_id=m.head_checkpoint_id or None,
        context_policy=m.context_policy or "error",
        truncations=m.truncations,
        dropped_tokens=m.dropped_tokens,
        holder=m.holder,
        tools=tuple(tool_from_pb(t) for t in m.tools),
        location=m.location,
        expires_at=m.expires_at,
        forked_from=m.forked_from,
    )


def checkpoint_info_to_pb(c: CheckpointInfo) -> pb.CheckpointInfo:
    """The message for a checkpoint."""
    return pb.CheckpointInfo(
        checkpoint_id=c.checkpoint_id,
        session_id=c.session_id,
        label=c.label or "",
        n_tokens=c.n_tokens,
        bytes_written=c.bytes_written,
        bytes_referenced=c.bytes_referenced,
        created_at=c.created_at,
    )


def checkpoint_info_from_pb(m: pb.CheckpointInfo) -> CheckpointInfo:
    """A checkpoint."""
    return CheckpointInfo(
        checkpoint_id=m.checkpoint_id,
        session_id=m.session_id,
        label=m.label or None,
        n_tokens=m.n_tokens,
        bytes_written=m.bytes_written,
        bytes_referenced=m.bytes_referenced,
        created_at=m.created_at,
    )


def response_page_from_pb(m: pb.ListResponsesResponse) -> ResponsePage:
    """A page of stored responses (ResponseInfo mirrors the message field for field)."""
    listed = tuple(
        ResponseInfo(**{f.name: getattr(r, f.name) for f in fields(ResponseInfo)}) for r in m.responses
    )
    return ResponsePage(listed, m.has_more)


# Info mirrors GetInfoResponse field for field, so both directions copy by name.
def info_to_pb(i: Info) -> pb.GetInfoResponse:
    """The message for the daemon's description."""
    return pb.GetInfoResponse(**{f.name: getattr(i, f.name) for f in fields(Info)})


def info_from_pb(m: pb.GetInfoResponse) -> Info:
    """The daemon's description."""
    return Info(**{f.name: getattr(m, f.name) for f in fields(Info)})


def create_session_request(
    system_prompt: str,
    sampling: SamplingParams | None,
    stop: Sequence[str],
    persistent: bool,
    cache_salt: str | bytes | None = None,
    context_policy: str = "error",
    tools: Sequence[Tool] = (),
) -> pb.CreateSessionRequest:
    """The request that opens a session."""
    salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt or b""
    return pb.CreateSessionRequest(
        system_prompt=system_prompt,
        sampling=sampling_to_pb(sampling),
        stop=_strings(stop),
        persistent=persistent,
        cache_salt=salt,
        context_policy=context_policy,
        tools=[tool_to_pb(t) for t in tools],
    )


def generate_request(
    session_id: str,
    prompt: str | Sequence[int],
    *,
    max_tokens: int | None,
    stop: Sequence[str],
    sampling: SamplingParams | None,
    logprobs: int,
    parse_special: bool,
    grammar: str | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    return_progress: bool = False,
) -> pb.GenerateRequest:
    """The request for a raw continuation; a sequence of ints is a prompt of token ids."""
    request = pb.GenerateRequest(
        session_id=session_id,
        parse_special=parse_special,
        max_tokens=max_tokens,
        sampling=sampling_to_pb(sampling),
        stop=_strings(stop),
        logprobs=logprobs,
        grammar=grammar or "",
        json_schema=schema_text(json_schema),
        return_progress=return_progress,
    )
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


def chat_request(
    session_id: str,
    message: str | Sequence[Message],
    *,
    max_tokens: int | None,
    stop: Sequence[str],
    sampling: SamplingParams | None,
    logprobs: int,
    grammar: str | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    whole: bool = False,
    tools: Sequence[Tool] | None = None,
    tool_choice: str | Tool | None = None,
    parallel_tool_calls: bool | None = None,
    return_progress: bool = False,
) -> pb.ChatRequest:
    """The request for one chat turn: a user message, or messages of any roles."""
    if isinstance(message, str):
        if whole:
            raise ValueError("whole=True takes the whole conversation as messages, not one string")
        text, messages = message, []
    else:
        text, messages = "", [message_to_pb(m) for m in message]
    return pb.ChatRequest(
        session_id=session_id,
        message=text,
        messages=messages,
        whole=whole,
        max_tokens=max_tokens,
        sampling=sampling_to_pb(sampling),
        stop=_strings(stop),
        logprobs=logprobs,
        grammar=grammar or "",
        json_schema=schema_text(json_schema),
        tools=None if tools is None else pb.ToolList(tools=[tool_to_pb(t) for t in tools]),
        tool_choice=None if tool_choice is None else tool_choice_to_pb(tool_choice),
        parallel_tool_calls=parallel_tool_calls,
        return_progress=return_progress,
    )


def schema_text(schema: str | Mapping[str, Any] | None) -> str:
    """A JSON schema as the request carries it: JSON text (a dict is serialized)."""
    if schema is None:
        return ""
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, Mapping):
        raise TypeError(f"json_schema must be a dict or a JSON string, not {type(schema).__name__}")
    return json.dumps(schema)
