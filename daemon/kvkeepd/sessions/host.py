"""SessionHost: what the session flows need of the registry that holds the sessions.

The flows (generation, checkpoints, hand-over, expiry) find sessions, hold their locks,
register the sessions they make and drop the ones they let go through this interface, and
get everything else (the residency, persistence, engine, settings) as collaborators of their
own. SessionManager is the one implementation; typing against this keeps the flows from
reaching back into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from kvkeepd.sessions.ledger import Counters
from kvkeepd.sessions.ops import Ops
from kvkeepd.sessions.session import Session
from kvkeepd.sessions.tenants import Tenant


class SessionHost(Protocol):
    """The registry of sessions, as the flows use it."""

    @property
    def sessions(self) -> Mapping[str, Session]:
        """The registered sessions by id (read-only: `register` and `unregister` change it)."""
        ...

    @property
    def ops(self) -> Ops: ...

    def clock(self) -> float: ...

    def get(self, session_id: str, tenant: Tenant) -> Session:
        """The tenant's open session with this id; InvalidRequest or NotFound otherwise."""
        ...

    async def find(self, session_id: str, tenant: Tenant) -> Session:
        """As `get`, and with a shared catalog a session another daemon let go, taken over."""
        ...

    def use(self, session: Session) -> AbstractAsyncContextManager[None]:
        """Hold the session's lock (waiting may be cut short); NotFound once it is closed."""
        ...

    def touch(self, session: Session) -> None:
        """The session was used now, and changed."""
        ...

    def check_quota(self, tenant: Tenant) -> None:
        """Busy when the tenant holds as many sessions as its quota allows."""
        ...

    def register(self, session: Session) -> None:
        """A session the Residency tracks becomes one the requests find."""
        ...

    def unregister(self, session: Session) -> None:
        """The session is no longer found (closed, or let go to another daemon)."""
        ...

    def publish(self) -> Counters:
        """Recompute the counters the metrics read."""
        ...
