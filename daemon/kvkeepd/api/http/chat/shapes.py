"""Response bodies of OpenAI's chat completions and completions: completions, their stream
chunks, usage and logprobs, as OpenAI's API shapes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvkeepd.api.http.logprobs import logprobs
from kvkeepd.api.http.openai import FINISH
from kvkeepd.values.generation import Chunk, GeneratedToken, PromptProgress, Usage
from kvkeepd.values.toolcall import CallDelta, ToolCall, join_deltas


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
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.reused_tokens},
    }


def prompt_progress(p: PromptProgress) -> dict[str, Any]:
    """A progress report as llama-server's streams carry it (`prompt_progress`)."""
    return {"total": p.total, "cache": p.cached, "processed": p.processed, "time_ms": round(p.time_ms)}


class Reply:
    """The constant part of every body of one response: id, times, model, session, and the
    system fingerprint (what a reply depends on besides the request)."""

    def __init__(
        self, kind: str, response_id: str, created: int, model: str, session_id: str | None, fingerprint: str
    ) -> None:
        self.kind = kind
        self.response_id = response_id
        self.created = created
        self.model = model
        self.session_id = session_id
        self.fingerprint = fingerprint

    def _head(self, obj: str) -> dict[str, Any]:
        head: dict[str, Any] = {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
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
                    "logprobs": {"content": logprobs(tokens, top)} if tokens else None,
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
                    "logprobs": {"content": logprobs(c.logprobs, top)} if c.logprobs else None,
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
