"""Request bodies refused by their size (413) before they are read whole or parsed: each
path's limit is what its largest valid request can need, within `--max-message-bytes`.

A JSON body takes several times its bytes once parsed (a list of a million token ids is
tens of MB of Python ints), so a body that cannot be valid is refused by its length alone:
its declared `content-length`, or, for a chunked body, as soon as what arrived passes the
limit (held meanwhile: at most the limit).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from kvkeepd.api.http.openai import error
from kvkeepd.request_limits import MAX_STOP_LENGTH, MAX_STOP_STRINGS

if TYPE_CHECKING:
    from kvkeepd.api.http.app import OpenAiDoor

# ASGI's types (as Starlette names them; the door's stack stays in app.py and door.py).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# JSON characters per byte of text at most (a control character is written \u00XX).
JSON_BYTES_PER_BYTE = 6
# JSON characters of a token id in a list: at most 10 digits and a comma.
JSON_TOKEN_ID = 11
# The fields of a completion body besides its prompt and stop strings (model, sampling...).
OTHER_FIELDS = 16 << 10


def body_limits(*, prompt_limit: int, max_token_bytes: int, max_message_bytes: int) -> dict[str, int]:
    """The body limit of each path whose bodies are bounded by more than the message limit.

    A legacy completion holds one prompt, as text (at most `max_token_bytes` per token,
    Tokenizer.check_bytes) or token ids. Chat completions carry whole conversations, which
    may be longer than the context (earlier turns are dropped): only the message limit
    bounds them."""
    prompt = max(prompt_limit * max_token_bytes * JSON_BYTES_PER_BYTE, prompt_limit * JSON_TOKEN_ID)
    stop = MAX_STOP_STRINGS * (MAX_STOP_LENGTH * JSON_BYTES_PER_BYTE + 4)
    return {"/v1/completions": min(prompt + stop + OTHER_FIELDS, max_message_bytes)}


def limited(door: OpenAiDoor) -> BodyLimit:
    """The door's application behind the body limits of its paths."""
    m = door.manager
    limits = body_limits(
        prompt_limit=m.settings.prompt_limit,
        max_token_bytes=m.model.max_token_bytes,
        max_message_bytes=door.body_limit,
    )
    return BodyLimit(door.asgi, limits, door.body_limit)


class BodyLimit:
    """ASGI middleware: a request whose body is beyond its path's limit (or `default`) gets
    413 before the application reads it."""

    def __init__(self, app: ASGIApp, limits: Mapping[str, int], default: int) -> None:
        self.app = app
        self.limits = limits
        self.default = default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope["path"], self.default)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            # The server holds a body to its declared length.
            if not declared.isdigit() or int(declared) <= limit:
                await self.app(scope, receive, send)
            else:
                await _refuse(send, limit)
            return
        body, first = bytearray(), None
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first = message  # the client left: the application learns it
                break
            body += message.get("body", b"")
            if len(body) > limit:
                await _refuse(send, limit)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), first, receive), send)


async def _refuse(send: Send, limit: int) -> None:
    """413, with the error body the application gives (app.py)."""
    message = f"the request body is larger than the limit of {limit} bytes"
    body = json.dumps(error("request_too_large", message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, last: Message | None, receive: Receive) -> Receive:
    """A receive that gives the body read already, then what `receive` gives."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if last is not None:
        pending = [last]

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
