"""What the door's application (app.py) gives an API's handlers: the manager, the served
model's name, the sessions kept between requests, how a caller is resolved and a body read,
and how often a quiet stream sends a heartbeat."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass

from starlette.requests import Request

from kvkeepd.api.http.keep import SessionKeep
from kvkeepd.sessions.manager import SessionManager
from kvkeepd.sessions.tenants import Tenant


@dataclass(eq=False)
class Handlers:
    """An API's handlers over the door's manager; `tenant` resolves a request's caller,
    `body` reads its body within the door's limit; `keep` holds the sessions of
    conversations sent whole; a stream that says nothing for `heartbeat` seconds sends a
    heartbeat. A request may name any model (`model_id` is the one served)."""

    manager: SessionManager
    model_id: str
    keep: SessionKeep
    _: KW_ONLY
    tenant: Callable[[Request], Tenant]
    body: Callable[[Request], Awaitable[bytes]]
    heartbeat: float
