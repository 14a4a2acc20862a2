"""Server-sent events, as every API of the HTTP door streams them, and the heartbeats that
keep a stream alive while it has nothing to say."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

# A stream's response headers besides its media type: no cache holds an event back.
STREAM_HEADERS = {"cache-control": "no-cache"}


def sse(data: dict[str, Any] | str, event: str = "") -> bytes:
    """One server-sent event: `data` as JSON (or the text given), named `event` where given."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    named = f"event: {event}\n" if event else ""
    return f"{named}data: {text}\n\n".encode()


async def beating(first: T, items: AsyncIterator[T], every: float) -> AsyncGenerator[T | None, None]:
    """`first`, then the items of `items`, and None each time `every` seconds pass without
    one: where the stream sends a heartbeat. A client's idle timeout counts only events with data (Codex
    CLI's is reset by each event its SSE parser yields, and a comment yields none), so a
    heartbeat is an event of the API's own; without one, a long prompt's evaluation looks
    like a dead connection."""
    yield first
    wanted = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait((wanted,), timeout=every)
            if not done:
                yield None
                continue
            try:
                item = wanted.result()
            except StopAsyncIteration:
                return
            yield item
            wanted = asyncio.ensure_future(anext(items))
    finally:
        if not wanted.done():
            # Cancelled, the stream stops its generation as a reader that leaves does.
            wanted.cancel()
            await asyncio.wait((wanted,))
        if not wanted.cancelled():
            wanted.exception()  # retrieved: a failure after the reader left is nobody's news
