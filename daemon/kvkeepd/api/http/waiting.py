"""A handler's work as the door waits for it: watching its client (one that leaves stops
the work), and noting what it cost in the request's access line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive

from kvkeepd.api.access import Access
from kvkeepd.values.generation import Chunk

T = TypeVar("T")


async def unless_left(request: Request, work: Awaitable[T]) -> T:
    """What `work` gives, unless the client leaves first: then `work` is cancelled, which
    stops its generation as a stream's reader that leaves does (within one engine step), and
    ClientDisconnect. uvicorn goes on running a request whose client left; only the
    application learns of it, by the ASGI message `http.disconnect`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(left(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            # Until the generation has been told to stop and its stream is closed.
            await asyncio.wait((task,))
    if task.cancelled():
        raise ClientDisconnect
    return task.result()


async def left(receive: Receive) -> None:
    """Return once the client has gone (its request's body already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def client_closed(request: Request) -> Response:
    """The answer to a client that hung up before its reply (ClientDisconnect): nobody reads
    it, the access log does, as nginx's 499 "client closed request"."""
    access(request).reason = "client_closed_request"
    return Response(status_code=499)


def access(request: Request) -> Access:
    """The access log's line of this request (a stand-in for one the door did not make)."""
    found = request.scope.get("state", {}).get("access")
    return found if isinstance(found, Access) else Access("http", request.url.path)


async def counted(request: Request, stream: AsyncIterator[Chunk]) -> AsyncGenerator[Chunk, None]:
    """The stream, its usage noted in the request's access line once the last chunk passes."""
    async with contextlib.aclosing(aiter(stream)) as chunks:  # type: ignore[type-var]
        async for chunk in chunks:
            if chunk.usage is not None:
                access(request).tokens(chunk.usage.prompt_tokens, chunk.usage.generated_tokens)
            yield chunk
