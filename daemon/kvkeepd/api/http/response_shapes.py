"""The bodies of OpenAI's Responses API: the response object, its output items and usage,
the input items listing, and the server-sent events of a streamed response (each with its
`sequence_number`), live or replayed from a stored response."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvkeepd.api.http.bodies import FINISH
from kvkeepd.api.http.response_schema import ResponseCreate, ResponseSpec
from kvkeepd.values import Chunk, GeneratedToken, SamplingParams, Usage


def event(kind: str, number: int, **fields: Any) -> bytes:
    """One server-sent event, named as its type."""
    data = json.dumps({"type": kind, "sequence_number": number, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


def usage(u: Usage) -> dict[str, Any]:
    """The Responses API's usage: the whole input, of which `cached_tokens` were not
    evaluated again."""
    return {
        "input_tokens": u.context_tokens,
        "input_tokens_details": {"cached_tokens": u.reused_tokens},
        "output_tokens": u.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.context_tokens + u.generated_tokens,
    }


def logprobs(tokens: Sequence[GeneratedToken], top: int) -> list[dict[str, Any]]:
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


@dataclass
class ResponseShape:
    """Everything one response's bodies share: its id, times, the request's echoed fields;
    and the sequence numbers of its events."""

    response_id: str
    created_at: int
    model: str
    body: ResponseCreate
    spec: ResponseSpec
    message_id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))
    number: int = 0

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
            finish = FINISH.get(last.finish_reason or "", "stop")
            complete = finish == "stop"
            out["status"] = status or ("completed" if complete else "incomplete")
            if not complete:
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["output"] = [self.message(chunks, "completed" if complete else "incomplete")]
            out["usage"] = usage(last.usage or Usage())
        return out

    def message(self, chunks: Sequence[Chunk], status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [self.part("".join(c.text for c in chunks), [g for c in chunks for g in c.logprobs])],
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
        """The events before the first delta."""
        started = self.response(None)
        yield self._event("response.created", response=started)
        yield self._event("response.in_progress", response=started)
        item = {
            "id": self.message_id,
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        yield self._event("response.output_item.added", output_index=0, item=item)
        yield self._event(
            "response.content_part.added",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            part=self.part("", []),
        )

    def delta(self, chunk: Chunk) -> Iterator[bytes]:
        if chunk.text:
            lp = logprobs(chunk.logprobs, self.body.top_logprobs or 0) if self.spec.logprobs else []
            yield self._event(
                "response.output_text.delta",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                delta=chunk.text,
                logprobs=lp,
            )

    def closing(self, chunks: Sequence[Chunk]) -> Iterator[bytes]:
        """The events after the last delta."""
        final = self.response(chunks)
        item = final["output"][0]
        part = item["content"][0]
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
        yield self._event("response.content_part.done", **where, part=part)
        yield self._event("response.output_item.done", output_index=0, item=item)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield self._event(kind, response=final)

    def failure(self, code: str, message: str, chunks: Sequence[Chunk]) -> Iterator[bytes]:
        """The events of a stream that failed after it began."""
        yield self._event("error", code=code, message=message, param=None)
        failed = self.response(None, "failed")
        failed["error"] = {"code": "server_error" if code == "server_error" else code, "message": message}
        yield self._event("response.failed", response=failed)


def replay(document: dict[str, Any], after: int = -1) -> Iterator[bytes]:
    """A stored response's events, as a stream of it gave them (a message's text in one
    delta): those numbered after `after`."""
    final = document["response"]
    started = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
    ]
    for index, item in enumerate(final["output"]):
        events.append(
            (
                "response.output_item.added",
                {"output_index": index, "item": {**item, "status": "in_progress", "content": []}},
            )
        )
        for c, part in enumerate(item.get("content", [])):
            where = {"item_id": item["id"], "output_index": index, "content_index": c}
            events.append(
                ("response.content_part.added", {**where, "part": {**part, "text": "", "logprobs": []}})
            )
            events.append(
                ("response.output_text.delta", {**where, "delta": part["text"], "logprobs": part["logprobs"]})
            )
            events.append(
                ("response.output_text.done", {**where, "text": part["text"], "logprobs": part["logprobs"]})
            )
            events.append(("response.content_part.done", {**where, "part": part}))
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    events.append((kind, {"response": final}))
    for number, (name, fields) in enumerate(events):
        if number > after:
            yield event(name, number, **fields)


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
