"""Request bodies' common ground: reading one within the door's limit, the base of their typed
models and their parsing, the roles of OpenAI's messages, and the cache salt a request may give."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from kvkeepd import bulk
from kvkeepd.errors import InvalidRequest
from kvkeepd.sessions.tenants import MAX_SALT, MIN_SALT

# Roles of OpenAI's messages and the template role each becomes (a Responses input message
# has no tool role: a tool's result is an item of its own there).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

M = TypeVar("M", bound=BaseModel)


class BodyTooLarge(Exception):
    """A request body beyond the daemon's message limit (413)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read within `limit` bytes (BodyTooLarge beyond it, by its declared
    length or as soon as what arrived passes it)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise BodyTooLarge
    return bytes(body)


async def parsed(raw: bytes, model: type[M]) -> M:
    """`raw` as a `model` (pydantic's ValidationError where it is not one), parsed beside the
    event loop when it is large (bulk.py)."""
    return await bulk.run(lambda: model.model_validate_json(raw), large=len(raw) > bulk.LARGE_BYTES)


class Body(BaseModel):
    """A request body's model: a field given the wrong JSON type is refused ("1" is no number
    and 1 is no boolean; ints are still accepted as floats), and fields it does not name are
    ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ClosedBody(Body):
    """A body whose fields it does not name are refused, as OpenAI's Responses API refuses
    them ("unknown parameter")."""

    model_config = ConfigDict(strict=True, extra="forbid")


def salt_bytes(cache_salt: str | None) -> bytes:
    """A body's `cache_salt` (an extension, vLLM's name: prompts computed under one salt are
    reused by requests giving the same, of any tenant, and by no other) as the bytes a
    session's salt is made from; b"" for none. A salt of the wrong length is refused here,
    before a session is made for it."""
    if cache_salt is None:
        return b""
    salt = cache_salt.encode("utf-8", "surrogatepass")
    if not MIN_SALT <= len(salt) <= MAX_SALT:
        raise InvalidRequest(
            f"cache_salt must have {MIN_SALT} to {MAX_SALT} bytes (UTF-8), got {len(salt)}", "cache_salt"
        )
    return salt
