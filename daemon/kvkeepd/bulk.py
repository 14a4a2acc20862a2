"""Work in proportion to a request's size (parsing its body, converting and checking its
messages), run beside the event loop when the request is large: one large request, even a
refused one, never holds up other callers' small ones. A small request's work stays on the
loop, where it costs no thread's hand-over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: A request of more bytes than this is parsed in a worker thread (about a millisecond of
#: parsing stays on the loop).
LARGE_BYTES = 64 << 10
#: A conversation of more messages than this is converted and checked in a worker thread.
LARGE_MESSAGES = 512


async def run(fn: Callable[[], T], *, large: bool) -> T:
    """`fn()`: in a worker thread when `large`, else on the calling loop."""
    if not large:
        return fn()
    return await asyncio.to_thread(fn)
