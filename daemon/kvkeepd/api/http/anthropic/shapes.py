"""The bodies of Anthropic's Messages API: a message with its content blocks, stop reason and
usage, the server-sent events of a streamed one, and the error envelope with its statuses.

Usage tells what the prompt cost, in three parts that add up to it:
`cache_read_input_tokens` were not evaluated again (the session's history, or blocks the
prefix cache attached), `cache_creation_input_tokens` were evaluated and newly kept as a
cache breakpoint's prefix, and `input_tokens` were evaluated only. A stream's
`message_start` says what was read before the prompt runs; its `message_delta` says all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from kvkeepd.api.http.sse import sse
from kvkeepd.errors import KvkeepError
from kvkeepd.values.generation import Chunk, PromptProgress, Usage
from kvkeepd.values.toolcall import ToolCall, join_deltas

# The engine's finish reasons as Anthropic's stop reasons (a cancelled reply's client is gone).
STOP_REASONS = {
    "eos": "end_turn",
    "stop": "stop_sequence",
    "length": "max_tokens",
    "context_full": "model_context_window_exceeded",
    "cancelled": "end_turn",
    "tool_calls": "tool_use",
}
# Each error class's HTTP status and Anthropic error type (docs/http.md).
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "FAILED_PRECONDITION": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "DATA_LOSS": (500, "api_error"),
    "INTERNAL": (500, "api_error"),
    "UNAVAILABLE": (529, "overloaded_error"),
}
INTERNAL_MESSAGE = "internal error (see the daemon's log)"


def error(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error envelope."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def domain_error(e: KvkeepError) -> tuple[int, dict[str, Any]]:
    """The status and envelope of a domain error; a bare KvkeepError says nothing of itself."""
    status, kind = STATUS.get(e.code, STATUS["INTERNAL"])
    return status, error(kind, INTERNAL_MESSAGE if type(e) is KvkeepError else str(e))


def usage(u: Usage, kept: int = 0) -> dict[str, int]:
    """The prompt's tokens in three parts that add up to it: those read from what was
    computed before, those evaluated and kept (the first `kept` tokens of the prompt were
    newly stored as a breakpoint's prefix), and those evaluated only; the reply's tokens."""
    read = u.reused_tokens
    created = max(0, min(kept, u.prompt_tokens) - read)
    return {
        "input_tokens": u.prompt_tokens - read - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
        "output_tokens": u.generated_tokens,
    }


def event(data: dict[str, Any]) -> bytes:
    """One server-sent event, named by its type as Anthropic's are."""
    return sse(data, data["type"])


def tool_use(call: ToolCall) -> dict[str, Any]:
    """A call as a `tool_use` block: its input is the arguments' object ({} for arguments cut
    short by max_tokens)."""
    try:
        value = json.loads(call.arguments or "{}")
    except ValueError:
        value = {}
    return {
        "type": "tool_use",
        "id": call.call_id,
        "name": call.name,
        "input": value if isinstance(value, dict) else {},
    }


class MessageShape:
    """One reply's bodies: its id and model, and, streamed, where its content blocks are."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._blocks = 0
        self._open: str | None = None  # the streamed block open now: "text", "tool_use" or none

    def _head(self) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model}

    def _ending(self, c: Chunk) -> dict[str, Any]:
        reason = STOP_REASONS.get(c.finish_reason or "", "end_turn")
        return {"stop_reason": reason, "stop_sequence": c.stop_sequence or None}

    def message(self, chunks: Sequence[Chunk], kept: int = 0) -> dict[str, Any]:
        """The whole reply; `kept`: the prompt's tokens newly stored (see `usage`)."""
        last = chunks[-1]
        text = "".join(c.text for c in chunks)
        calls = join_deltas((), (d for c in chunks for d in c.tool_calls))
        content = [{"type": "text", "text": text}] if text else []
        content += [tool_use(c) for c in calls]
        return {
            **self._head(),
            "content": content,
            **self._ending(last),
            "usage": usage(last.usage or Usage(), kept),
        }

    # ---- streamed --------------------------------------------------------------------------

    def opening(self, first: Chunk) -> Iterator[bytes]:
        """`message_start`, with what the prompt's first progress report says it costs,
        and a `ping`."""
        p = first.progress or PromptProgress(0, 0, 0, 0.0)
        start = {
            "input_tokens": p.total - p.cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": p.cached,
            "output_tokens": 0,
        }
        message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": start}
        yield event({"type": "message_start", "message": message})
        yield event({"type": "ping"})

    def delta(self, c: Chunk) -> Iterator[bytes]:
        """The events of a chunk: text in a text block, each call in a tool_use block (its
        id and name at its start, its arguments as `input_json_delta`s)."""
        if c.text:
            if self._open != "text":
                yield from self._start({"type": "text", "text": ""}, "text")
            yield self._delta({"type": "text_delta", "text": c.text})
        for d in c.tool_calls:
            if d.name:
                block = {"type": "tool_use", "id": d.call_id, "name": d.name, "input": {}}
                yield from self._start(block, "tool_use")
            if d.arguments:
                yield self._delta({"type": "input_json_delta", "partial_json": d.arguments})

    def closing(self, last: Chunk, kept: int = 0) -> Iterator[bytes]:
        """The open block's end, the stop reason with the usage (`kept`: see `usage`),
        `message_stop`."""
        yield from self._stop()
        u = usage(last.usage or Usage(), kept)
        yield event({"type": "message_delta", "delta": self._ending(last), "usage": u})
        yield event({"type": "message_stop"})

    def _start(self, block: dict[str, Any], kind: str) -> Iterator[bytes]:
        yield from self._stop()
        yield event({"type": "content_block_start", "index": self._blocks, "content_block": block})
        self._open = kind

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self._blocks, "delta": delta})

    def _stop(self) -> Iterator[bytes]:
        if self._open is not None:
            yield event({"type": "content_block_stop", "index": self._blocks})
            self._blocks += 1
            self._open = None
