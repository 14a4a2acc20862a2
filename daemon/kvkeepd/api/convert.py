"""Protobuf messages <-> the daemon's values, for the gRPC servicer (service.py): the one place
the proto's enums, roles and finish reasons meet the daemon's names. The client's
`kvkeep._convert` is the mirror image."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from kvkeep.v1 import kvkeep_pb2 as pb
from kvkeepd.engine.backend import GPU_KINDS, Device
from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.flows.response_list import StoredResponse
from kvkeepd.sessions.manager import SessionView
from kvkeepd.sessions.placement import Tier
from kvkeepd.storage.catalog import CheckpointRow, ListedSession
from kvkeepd.values.generation import Chunk, FinishReason, Turn
from kvkeepd.values.messages import ChatMessage, Message
from kvkeepd.values.sampling import SAMPLING_FIELDS, SamplingOverrides, SamplingParams
from kvkeepd.values.toolcall import CallDelta, Tool, ToolCall, ToolChoice

FINISH: dict[FinishReason, pb.FinishReason.ValueType] = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "context_full": pb.FINISH_REASON_CONTEXT_FULL,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
RESIDENCY: dict[Tier, pb.Residency.ValueType] = {
    "hot": pb.RESIDENCY_HOT,
    "warm": pb.RESIDENCY_WARM,
    "cold": pb.RESIDENCY_COLD,
}
ROLES = {
    "system": pb.ROLE_SYSTEM,
    "user": pb.ROLE_USER,
    "assistant": pb.ROLE_ASSISTANT,
    "tool": pb.ROLE_TOOL,
}


def overrides_from_pb(p: pb.SamplingParams) -> SamplingOverrides:
    return SamplingOverrides.of(
        **{name: getattr(p, name) if p.HasField(name) else None for name in SAMPLING_FIELDS}  # type: ignore[arg-type]
    )


def turn_from_pb(r: pb.GenerateRequest | pb.ChatRequest) -> Turn:
    turn = Turn(
        max_tokens=r.max_tokens if r.HasField("max_tokens") else None,
        sampling=overrides_from_pb(r.sampling),
        stop=list(r.stop),
        logprobs=r.logprobs,
        grammar=r.grammar,
        json_schema=r.json_schema,
        progress=r.return_progress,
    )
    if not isinstance(r, pb.ChatRequest):
        return turn
    return dataclasses.replace(
        turn,
        tools=tools_from_pb(r.tools.tools) if r.HasField("tools") else None,
        tool_choice=ToolChoice.of(r.tool_choice.mode, r.tool_choice.function)
        if r.HasField("tool_choice")
        else None,
        parallel_tool_calls=r.parallel_tool_calls if r.HasField("parallel_tool_calls") else True,
    )


def tools_from_pb(tools: Iterable[pb.Tool]) -> tuple[Tool, ...]:
    return tuple(Tool(t.name, t.description, t.parameters) for t in tools)


def tool_to_pb(t: Tool) -> pb.Tool:
    return pb.Tool(name=t.name, description=t.description, parameters=t.parameters)


def calls_from_pb(calls: Iterable[pb.ToolCall]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.call_id, c.name, c.arguments) for c in calls)


def call_to_pb(c: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(call_id=c.call_id, name=c.name, arguments=c.arguments)


def delta_to_pb(d: CallDelta) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=d.index, call_id=d.call_id, name=d.name, arguments=d.arguments)


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


def message_from_pb(m: pb.Message) -> Message:
    role = next((name for name, value in ROLES.items() if value == m.role), None)
    if role is None:
        raise InvalidRequest("every message needs a role: system, user, assistant or tool")
    return Message(role, m.content, calls_from_pb(m.tool_calls), m.tool_call_id)


def message_to_pb(m: ChatMessage) -> pb.Message:
    return pb.Message(
        role=ROLES[m.role],
        content=m.content,
        tool_calls=[call_to_pb(c) for c in m.tool_calls],
        tool_call_id=m.tool_call_id,
    )


def session_to_pb(v: SessionView, n_ctx: int) -> pb.SessionInfo:
    s = v.session
    return pb.SessionInfo(
        session_id=s.session_id,
        persistent=s.persistent,
        n_tokens=v.n_tokens,
        n_ctx=n_ctx,
        sampling=params_to_pb(s.params),
        stop=list(s.stop),
        messages=[message_to_pb(m) for m in s.messages],
        residency=RESIDENCY[v.tier],
        created_at=s.created_at,
        last_used_at=s.last_used_at,
        n_checkpoints=v.n_checkpoints,
        head_checkpoint_id=s.head_checkpoint_id,
        context_policy=s.context_policy,
        truncations=s.truncations,
        dropped_tokens=s.dropped_tokens,
        holder=v.holder,
        tools=[tool_to_pb(t) for t in s.tools],
        location=v.location,
        expires_at=v.expires_at,
        forked_from=s.forked_from,
    )


def listed_to_pb(r: ListedSession, n_ctx: int, location: str, expires_at: float) -> pb.SessionInfo:
    """A persistent session no one holds here, as the catalog has it: what its head's row
    says (its sampling, stop strings and messages are in the head's manifest, which GetSession
    reads as it takes the session over), its head kept at `location`."""
    return pb.SessionInfo(
        session_id=r.session_id,
        persistent=True,
        n_tokens=r.n_tokens,
        n_ctx=n_ctx,
        residency=pb.RESIDENCY_COLD,
        created_at=r.created_at,
        last_used_at=r.last_used_at,
        n_checkpoints=r.n_checkpoints,
        head_checkpoint_id=r.head,
        holder=r.holder,
        location=location,
        expires_at=expires_at,
    )


def checkpoint_to_pb(r: CheckpointRow) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        checkpoint_id=r.checkpoint_id,
        session_id=r.session_id,
        label=r.label,
        n_tokens=r.n_tokens,
        bytes_written=r.bytes_written,
        bytes_referenced=r.bytes_referenced,
        created_at=r.created_at,
    )


def response_to_pb(r: StoredResponse) -> pb.ResponseInfo:
    # ResponseInfo mirrors StoredResponse field for field.
    return pb.ResponseInfo(**dataclasses.asdict(r))


def chunk_to_pb(c: Chunk) -> pb.GenerationChunk:
    out = pb.GenerationChunk(
        text=c.text, token_ids=list(c.token_ids), tool_calls=[delta_to_pb(d) for d in c.tool_calls]
    )
    for g in c.logprobs:
        item = out.logprobs.add()
        item.sampled.CopyFrom(
            pb.TokenLogprob(token_id=g.sampled.token_id, text=g.sampled.text, logprob=g.sampled.logprob)
        )
        item.top.extend(pb.TokenLogprob(token_id=t.token_id, text=t.text, logprob=t.logprob) for t in g.top)
    if c.progress is not None:
        p = c.progress
        out.prompt_progress.CopyFrom(
            pb.PromptProgress(total=p.total, cached=p.cached, processed=p.processed, time_ms=p.time_ms)
        )
    if c.finish_reason is not None:
        out.finish_reason = FINISH[c.finish_reason]
    if c.usage is not None:
        out.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=c.usage.prompt_tokens,
                generated_tokens=c.usage.generated_tokens,
                reused_tokens=c.usage.reused_tokens,
                evaluated_tokens=c.usage.evaluated_tokens,
                dropped_tokens=c.usage.dropped_tokens,
                added_tokens=c.usage.added_tokens,
            )
        )
    return out


def device_fields(devices: Sequence[Device]) -> dict[str, Any]:
    """GetInfo's backend and device fields: the GPUs where the build has any, else the CPU."""
    shown = [d for d in devices if d.kind in GPU_KINDS] or [d for d in devices if d.kind == "cpu"]
    return {
        "backend": shown[0].backend if shown else "",
        "device": ", ".join(f"{d.name}: {d.description}" for d in shown),
        "device_memory_total": sum(d.memory_total for d in shown),
        "device_memory_free": sum(d.memory_free for d in shown),
    }
