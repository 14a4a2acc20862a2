"""Response bodies of the OpenAI-compatible door: completions, their stream chunks, usage,
logprobs and errors, as OpenAI's API shapes them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvkeepd.errors import InvalidRequest, KvkeepError
from kvkeepd.values.generation import Chunk, GeneratedToken, PromptProgress, Usage
from kvkeepd.values.toolcall import CallDelta, ToolCall, join_deltas

# The engine's finish reasons as OpenAI names them.
FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "context_full": "length",
    "cancelled": "stop",
    "tool_calls": "tool_calls",
}

# Each error class's HTTP status, OpenAI error type and code (docs/errors.md).
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", "invalid_value"),
    "OUT_OF_RANGE": (400, "invalid_request_error", "context_length_exceeded"),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "NOT_FOUND": (404, "not_found_error", "not_found"),
    "ALREADY_EXISTS": (409, "conflict_error", "conflict"),
    "FAILED_PRECONDITION": (409, "conflict_error", "conflict"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "DATA_LOSS": (500, "server_error", "server_error"),
    "INTERNAL": (500, "server_error", "server_error"),
    "UNAVAILABLE": (503, "service_unavailable", "service_unavailable"),
}
INTERNAL_MESSAGE = "internal error (see the daemon's log)"


def error(kind: str, message: str, code: str = "", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


def domain_error(e: KvkeepError, prompt: str = "messages") -> tuple[int, dict[str, Any]]:
    """The status and body of a domain error; a bare KvkeepError says nothing of itself.
    `code` is specific (`context_length_exceeded`...); errors that share a status name their
    cause in it (`no-chat-template`...), as gRPC's `kvkeep-error` metadata does. `param` is
    the request's field at fault where the error knows it (`prompt`: the field a full
    context blames, `messages` or `prompt`)."""
    status, kind, code = STATUS.get(e.code, STATUS["INTERNAL"])
    message = INTERNAL_MESSAGE if type(e) is KvkeepError else str(e)
    param = e.field or None if isinstance(e, InvalidRequest) else prompt if e.code == "OUT_OF_RANGE" else None
    return status, error(kind, message, e.cause or code, param)


def tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """A reply's calls as OpenAI's message has them."""
    return [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def tool_call_deltas(deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """A chunk's pieces of calls as OpenAI streams them: a call's first piece with its
    index, id, type and name, the next ones with its index and arguments; a call's pieces in
    one chunk are joined."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        elif d.name:
            function = {"name": d.name, "arguments": d.arguments}
            out.append({"index": d.index, "id": d.call_id, "type": "function", "function": function})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def usage(u: Usage) -> dict[str, Any]:
    """OpenAI's usage: the whole prompt, of which `cached_tokens` were not evaluated again."""
    return {
        "prompt_tokens": u.context_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.context_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.reused_tokens},
    }


def prompt_progress(p: PromptProgress) -> dict[str, Any]:
    """A progress report as llama-server's streams carry it (`prompt_progress`)."""
    return {"total": p.total, "cache": p.cached, "processed": p.processed, "time_ms": round(p.time_ms)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class Reply:
    """The constant part of every body of one response: id, times, model, session."""

    def __init__(self, kind: str, response_id: str, created: int, model: str, session_id: str | None) -> None:
        self.kind = kind
        self.response_id = response_id
        self.created = created
        self.model = model
        self.session_id = session_id

    def _head(self, obj: str) -> dict[str, Any]:
        head: dict[str, Any] = {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }
        if self.session_id is not None:
            head["session_id"] = self.session_id
        return head

    # ---- chat -------------------------------------------------------------------------------

    def chat(self, text: str, chunks: Sequence[Chunk], top: int) -> dict[str, Any]:
        last = chunks[-1]
        tokens = [g for c in chunks for g in c.logprobs]
        calls = join_deltas((), (d for c in chunks for d in c.tool_calls))
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = tool_calls(calls)
        return {
            **self._head("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": chat_logprobs(tokens, top)} if tokens else None,
                    "finish_reason": FINISH.get(last.finish_reason or "", "stop"),
                }
            ],
            "usage": usage(last.usage or Usage()),
        }

    def chat_chunk(self, c: Chunk, top: int, first: bool) -> dict[str, Any]:
        content = c.text if (c.text or not c.tool_calls) and c.progress is None else None
        delta: dict[str, Any] = {"content": content}
        if first or c.progress is not None:
            # llama-server's progress chunks: an empty assistant delta, the report beside it.
            delta["role"] = "assistant"
        if c.tool_calls:
            delta["tool_calls"] = tool_call_deltas(c.tool_calls)
        return {
            **self._head("chat.completion.chunk"),
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": {"content": chat_logprobs(c.logprobs, top)} if c.logprobs else None,
                    "finish_reason": FINISH.get(c.finish_reason, "stop") if c.finish_reason else None,
                }
            ],
            **_progress_of(c),
        }

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(u)}

    # ---- legacy completions -----------------------------------------------------------------

    def completion(self, text: str, chunks: Sequence[Chunk], top: int) -> dict[str, Any]:
        last = chunks[-1]
        tokens = [g for c in chunks for g in c.logprobs]
        return {
            **self._head("text_completion"),
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": completion_logprobs(tokens, top) if tokens else None,
                    "finish_reason": FINISH.get(last.finish_reason or "", "stop"),
                }
            ],
            "usage": usage(last.usage or Usage()),
        }

    def completion_chunk(self, c: Chunk, top: int) -> dict[str, Any]:
        return {
            **self._head("text_completion"),
            "choices": [
                {
                    "index": 0,
                    "text": c.text,
                    "logprobs": completion_logprobs(c.logprobs, top) if c.logprobs else None,
                    "finish_reason": FINISH.get(c.finish_reason, "stop") if c.finish_reason else None,
                }
            ],
            **_progress_of(c),
        }


def _progress_of(c: Chunk) -> dict[str, Any]:
    """The `prompt_progress` field of a progress chunk; nothing for another."""
    return {"prompt_progress": prompt_progress(c.progress)} if c.progress is not None else {}


def chat_logprobs(tokens: Sequence[GeneratedToken], top: int) -> list[dict[str, Any]]:
    return [
        {
            "token": g.sampled.text,
            "logprob": g.sampled.logprob,
            "bytes": list(g.sampled.text.encode()),
            "top_logprobs": [
                {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())} for t in g.top[:top]
            ],
        }
        for g in tokens
    ]


def completion_logprobs(tokens: Sequence[GeneratedToken], top: int) -> dict[str, Any]:
    offsets, at = [], 0
    for g in tokens:
        offsets.append(at)
        at += len(g.sampled.text)
    return {
        "tokens": [g.sampled.text for g in tokens],
        "token_logprobs": [g.sampled.logprob for g in tokens],
        "top_logprobs": [{t.text: t.logprob for t in g.top[:top]} for g in tokens],
        "text_offset": offsets,
    }
