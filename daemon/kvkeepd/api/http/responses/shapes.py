"""The bodies of OpenAI's Responses API: the response object, its output items and usage,
the input items listing, and the server-sent events of a streamed response (each with its
`sequence_number`), live or replayed from a stored response.

A response's output items are named after it (`msg_HEX`, `fc_HEX_N` for `resp_HEX`), so that
an `item_reference` finds the stored response that holds the item it names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvkeepd.api.http.logprobs import logprobs
from kvkeepd.api.http.openai import FINISH
from kvkeepd.api.http.responses.schema import ResponseCreate, ResponseSpec
from kvkeepd.api.http.sse import sse
from kvkeepd.sessions.flows.responses import RESPONSE_ID_PREFIX
from kvkeepd.values.generation import Chunk, GeneratedToken, Usage
from kvkeepd.values.sampling import SamplingParams
from kvkeepd.values.toolcall import CallDelta, join_deltas


def event(kind: str, number: int, **fields: Any) -> bytes:
    """One server-sent event, named as its type."""
    return sse({"type": kind, "sequence_number": number, **fields}, event=kind)


def usage(u: Usage) -> dict[str, Any]:
    """The Responses API's usage: the whole input, of which `cached_tokens` were not
    evaluated again."""
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.reused_tokens},
        "output_tokens": u.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.generated_tokens,
    }


#: The key of a reply's message among its output items (calls are keyed by their index).
MESSAGE = -1


def order(chunks: Sequence[Chunk]) -> list[int]:
    """A reply's output items in the order they began: its message (MESSAGE) where it has
    text, each call by its index; a reply with neither is one empty message. Within a chunk,
    its text comes first (a call's syntax follows the text before it)."""
    out: list[int] = []
    for c in chunks:
        if c.text and MESSAGE not in out:
            out.append(MESSAGE)
        out += [d.index for d in c.tool_calls if d.index not in out]
    return out or [MESSAGE]


# An output item's id: its kind's prefix, its response's hex, and a call's number.
_OUTPUT_ITEM = re.compile(r"^(?:msg_([0-9a-f]{24})|fc_([0-9a-f]{24})_\d{1,6})$")


def holder_of(item_id: str) -> str | None:
    """The id of the response whose output item this is (None: not an output item's id)."""
    found = _OUTPUT_ITEM.match(item_id)
    return RESPONSE_ID_PREFIX + (found[1] or found[2]) if found else None


@dataclass
class ResponseShape:
    """Everything one response's bodies share: its id, times, the request's echoed fields,
    its output items' ids; and, streamed, the items opened so far and the events' numbers."""

    response_id: str
    created_at: int
    model: str
    body: ResponseCreate
    spec: ResponseSpec
    opened: list[int] = field(default_factory=list)
    number: int = 0

    @property
    def message_id(self) -> str:
        return "msg_" + self.response_id.removeprefix(RESPONSE_ID_PREFIX)

    def item_id(self, key: int) -> str:
        if key == MESSAGE:
            return self.message_id
        return f"fc_{self.response_id.removeprefix(RESPONSE_ID_PREFIX)}_{key}"

    # ---- the response object -------------------------------------------------------------

    def response(self, chunks: Sequence[Chunk] | None, status: str = "") -> dict[str, Any]:
        """The response object: in progress (no chunks yet), or as `chunks` finished it."""
        b = self.body
        sampling = self.spec.turn.sampling.apply(SamplingParams())
        out: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status or "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": self.spec.instructions,
            "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": self.spec.store,
            "temperature": sampling.temperature,
            "text": {"format": (b.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"},
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "top_logprobs": b.top_logprobs or 0,
            "top_p": sampling.top_p,
            "truncation": b.truncation or "disabled",
            "usage": None,
            "user": b.user,
            "metadata": b.metadata or {},
        }
        if chunks:
            last = chunks[-1]
            complete = FINISH.get(last.finish_reason or "", "stop") in ("stop", "tool_calls")
            out["status"] = status or ("completed" if complete else "incomplete")
            if not complete:
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["output"] = self.output(chunks, "completed" if complete else "incomplete")
            out["usage"] = usage(last.usage or Usage())
        return out

    def output(self, chunks: Sequence[Chunk], status: str) -> list[dict[str, Any]]:
        calls = join_deltas((), (d for c in chunks for d in c.tool_calls))
        items = []
        for key in order(chunks):
            if key == MESSAGE:
                tokens = [g for c in chunks for g in c.logprobs]
                part = self.part("".join(c.text for c in chunks), tokens)
                items.append(self.message_item(status, [part]))
            else:
                call = calls[key]
                items.append(self.call_item(key, call.call_id, call.name, call.arguments, status))
        return items

    def message_item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def call_item(self, key: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        # A namespace's function is named as OpenAI names it: its name, and its namespace.
        space, name = self.spec.namespaces.get(name, ("", name))
        return {
            "id": self.item_id(key),
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            **({"namespace": space} if space else {}),
            "arguments": arguments,
            "status": status,
        }

    def part(self, text: str, tokens: Sequence[GeneratedToken]) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        part["logprobs"] = logprobs(tokens, self.body.top_logprobs or 0) if self.spec.logprobs else []
        return part

    def document(self, chunks: Sequence[Chunk]) -> dict[str, Any]:
        """What is stored with the response: the response object and its input items."""
        return {"response": self.response(chunks), "input": list(self.spec.items)}

    # ---- events --------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = event(kind, self.number, **fields)
        self.number += 1
        return out

    def opening(self) -> Iterator[bytes]:
        """The events before the reply's first piece."""
        started = self.response(None)
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)

    def heartbeat(self) -> bytes:
        """An event that says the response is still in progress (a stream's heartbeat)."""
        return self._event("response.in_progress", response=self.response(None))

    def _open(self, key: int, call: CallDelta | None = None) -> Iterator[bytes]:
        """An output item begins: its message (and its one part), or a call."""
        index = len(self.opened)
        self.opened.append(key)
        if key == MESSAGE:
            item = self.message_item("in_progress", [])
            yield self._event("response.output_item.added", output_index=index, item=item)
            yield self._event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=index,
                content_index=0,
                part=self.part("", []),
            )
        else:
            assert call is not None
            item = self.call_item(key, call.call_id, call.name, "", "in_progress")
            yield self._event("response.output_item.added", output_index=index, item=item)

    def delta(self, chunk: Chunk) -> Iterator[bytes]:
        """The events of one piece of the reply."""
        if chunk.text:
            if MESSAGE not in self.opened:
                yield from self._open(MESSAGE)
            lp = logprobs(chunk.logprobs, self.body.top_logprobs or 0) if self.spec.logprobs else []
            yield self._event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=self.opened.index(MESSAGE),
                content_index=0,
                delta=chunk.text,
                logprobs=lp,
            )
        for d in chunk.tool_calls:
            if d.index not in self.opened:
                yield from self._open(d.index, d)
            if d.arguments:
                yield self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.item_id(d.index),
                    output_index=self.opened.index(d.index),
                    delta=d.arguments,
                )

    def closing(self, chunks: Sequence[Chunk]) -> Iterator[bytes]:
        """The events after the reply's last piece: each item done, then the response."""
        final = self.response(chunks)
        if not self.opened:
            yield from self._open(MESSAGE)
        for index, item in enumerate(final["output"]):
            yield from _done(index, item, self._event)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=final)

    def failure(self, code: str, message: str) -> Iterator[bytes]:
        """The events of a stream that failed after it began."""
        yield self._event("error", code=code, message=message, param=None)
        failed = self.response(None, "failed")
        failed["error"] = {"code": code, "message": message}
        yield self._event("response.failed", response=failed)


def _done(index: int, item: dict[str, Any], emit: Any) -> Iterator[bytes]:
    """The events that finish an output item."""
    if item["type"] == "message":
        for c, part in enumerate(item["content"]):
            where = {"item_id": item["id"], "output_index": index, "content_index": c}
            yield emit("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
            yield emit("response.content_part.done", **where, part=part)
    else:
        where = {"item_id": item["id"], "output_index": index}
        yield emit(
            "response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"]
        )
    yield emit("response.output_item.done", output_index=index, item=item)


def replay(document: dict[str, Any], after: int = -1) -> Iterator[bytes]:
    """A stored response's events, as a stream of it gave them (each item's text or
    arguments in one delta): those numbered after `after`."""
    final = document["response"]
    started = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> bytes:
        events.append(event(kind, len(events), **fields))
        return events[-1]

    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            for c, part in enumerate(item["content"]):
                where = {"item_id": item["id"], "output_index": index, "content_index": c}
                emit("response.content_part.added", **where, part={**part, "text": "", "logprobs": []})
                emit("response.output_text.delta", **where, delta=part["text"], logprobs=part["logprobs"])
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            )
        list(_done(index, item, emit))
    emit("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
    yield from events[after + 1 :]


def listing(items: list[dict[str, Any]], *, after: str, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's cursor page of input items: `limit` of them in `order`, after the item
    `after` (none: from the first)."""
    ordered = items if order == "asc" else items[::-1]
    if after:
        ids = [i["id"] for i in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
