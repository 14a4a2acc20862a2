"""The checkpoint catalog: persistent sessions, their heads and leases, checkpoints (stored
responses among them, each with its record) and block references. `Catalog` is what the rest
of the daemon uses, and its rows are the values it answers with; `SqliteCatalog`
(catalog/sqlite.py) is the embedded one, `RedisCatalog` (catalog/redis.py) the one several
daemons share.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class CheckpointRow:
    checkpoint_id: str
    session_id: str
    label: str
    kind: str  # "head" (autosave), "explicit", "imported", "response"
    n_tokens: int
    bytes_written: int
    bytes_referenced: int
    created_at: float
    tenant: str = ""


#: Bytes of a stored response's record that a listing reads (`tenant_responses`): the
#: fields the record puts first.
RECORD_HEAD = 64


@dataclass(frozen=True)
class SessionRow:
    """A persistent session as the catalog records it."""

    created_at: float
    head: str | None
    tenant: str


@dataclass(frozen=True)
class ListedSession:
    """A persistent session as a listing reports it from the catalog: its row and its head."""

    session_id: str
    created_at: float  # when its first head was saved (as the session was created)
    last_used_at: float  # when its head or its newest turn record was saved
    head: str
    n_tokens: int  # its newest turn record's, else its head's
    n_checkpoints: int  # explicit ones
    holder: str = ""  # the daemon holding its lease ("" if none does)


@dataclass(frozen=True)
class Claim:
    """A save's claim on its blocks (`claim_blocks`): the sizes of those the catalog knows,
    those being deleted now (nothing was claimed then: wait and ask again), and when the
    claim was made (the catalog's clock; 0: a catalog with no collector)."""

    sizes: dict[str, int]
    busy: set[str]
    at: float = 0.0


@dataclass(frozen=True)
class Reservation:
    """A save's hold on its tenant's stored-bytes quota (`reserve_stored`): granted with an
    id, or refused (id ""); what the tenant held (stored, and reserved by saves under way)
    and what this save may add."""

    reservation_id: str
    held: int
    needed: int


@dataclass(frozen=True)
class Lease:
    """A session's lease as `take_lease` answers: granted with a fencing token (> 0), or
    held by another daemon for `wait_ms` more milliseconds (token 0)."""

    token: int
    wait_ms: int = 0


class Catalog(Protocol):
    """What a catalog offers; every write is atomic (a transaction or a server-side script),
    so a crash or an outage leaves it as it was before the write or after it. Methods block;
    the daemon calls them in worker threads."""

    #: Whether other daemons use this catalog too (sessions are found in it on demand,
    #: and leases matter).
    shared: bool

    @property
    def manifest_bytes(self) -> int:
        """Bytes of the manifests held (what a catalog in RAM takes, near enough)."""
        ...

    def file_bytes(self) -> int:
        """Bytes this catalog takes on the daemon's disk (0 in RAM or on a server)."""
        ...

    def close(self) -> None: ...

    def add_checkpoint(
        self,
        row: CheckpointRow,
        manifest: bytes,
        blocks: Iterable[tuple[str, int]],
        now: float,
        head_of: str | None = None,
        fence: int = 0,
        claimed_at: float = 0.0,
        response: bytes | None = None,
        reservation: str = "",
    ) -> str | None:
        """Commit a checkpoint and its references. With head_of, it becomes that session's
        head and the previous head is deleted; its id is returned. With a fence (a lease's
        token), the head moves only if no daemon took the session's lease since: Fenced
        otherwise, and nothing is written. `claimed_at`: its Claim's `at`; a claim older
        than the collector's grace period is refused (StaleClaim), as its blocks may be
        collected. With `response` (a stored response's record, kind "response"), the
        record commits with it and is deleted with it. `reservation`: the save's hold on
        its tenant's quota (`reserve_stored`), let go in the same commit, as what the
        checkpoint stores counts from then on; one that lapsed is StaleClaim."""
        ...

    def get(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes] | None: ...

    def checkpoints(self, session_id: str, include_heads: bool = False) -> list[CheckpointRow]: ...

    def response(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes] | None:
        """A stored response's checkpoint row and record, or None if there is none."""
        ...

    def old_responses(self, created_before: float, limit: int) -> list[str]:
        """Up to `limit` stored responses' checkpoint ids made before `created_before`,
        oldest first."""
        ...

    def expired_prefixes(self, now: float, limit: int) -> list[str]:
        """Up to `limit` kept prefixes' checkpoint ids (kind "prefix", whose label is their
        time to live in seconds) past their time at `now`, the longest expired first."""
        ...

    def tenant_checkpoints(self, tenant: str) -> list[CheckpointRow]:
        """A tenant's explicit and imported checkpoints, oldest first."""
        ...

    def tenant_responses(
        self, tenant: str, after: str, limit: int, descending: bool
    ) -> list[tuple[CheckpointRow, bytes]] | None:
        """A page of the tenant's stored responses in the order of their creation (then of
        their ids), oldest or newest first: up to `limit` of those after the response
        `after` ("": from the first), each with the first RECORD_HEAD bytes of its record.
        None if `after` is not one of the tenant's stored responses. Read by an index: a
        page costs the same whatever the tenant holds."""
        ...

    def stored_bytes(self, tenant: str) -> int:
        """Bytes a tenant stores: the distinct blocks its checkpoints reference (each once,
        however many share it), and each checkpoint's own manifest and stored response
        record."""
        ...

    def reserve_stored(
        self, tenant: str, blocks: Sequence[tuple[str, int]], own: int, limit: int
    ) -> Reservation:
        """Hold room under the tenant's stored-bytes quota `limit` for a save, atomically with
        every other save on any daemon of this catalog: what it may add (its `blocks`, (key,
        most bytes), that none of the tenant's checkpoints references, at the size the
        catalog records where it knows one; and its `own` manifest and record), beside what
        the tenant stores and the reservations of saves under way, must fit; else nothing
        is held. On a shared catalog a reservation lapses after the grace period of claims
        (a save has committed or failed by then)."""
        ...

    def release_stored(self, tenant: str, reservation_id: str) -> None:
        """Let a reservation go (its save failed); one already gone is no error."""
        ...

    def delete(self, checkpoint_id: str) -> bool:
        """Delete a checkpoint (a head it was is cleared); False if there was none."""
        ...

    def delete_session(self, session_id: str, fence: int = 0) -> None:
        """Forget a session, its head (if persistent), its lease and all its checkpoints
        (fenced as add_checkpoint's head is)."""
        ...

    def sessions(self) -> list[tuple[str, float, str | None]]:
        """Persistent sessions: (session_id, created_at, head checkpoint id or None)."""
        ...

    def session(self, session_id: str) -> SessionRow | None:
        """One persistent session, or None if the catalog has none."""
        ...

    def tenant_sessions(self, tenant: str, limit: int) -> list[ListedSession]:
        """The tenant's persistent sessions that have a head, the `limit` most recently used
        (in one round trip to the catalog)."""
        ...

    def expire_sessions(self, idle_before: float, limit: int) -> list[str]:
        """Delete (as delete_session does) up to `limit` persistent sessions whose head was
        saved before `idle_before` and whose lease no daemon holds, each at most once however
        many daemons ask; returns their ids. The session's fencing token moves on, so a
        daemon whose lease lapsed never writes it again."""
        ...

    def counts(self, session_ids: Sequence[str]) -> dict[str, int]:
        """Explicit checkpoints per session, of these sessions (one lookup each, whatever
        the catalog holds). Sessions without any are left out."""
        ...

    def touch(self, keys: Iterable[str], now: float) -> None: ...

    def present(self, keys: list[str]) -> set[str]:
        """Which of these blocks the catalog knows."""
        ...

    def block_size(self, key: str) -> int | None: ...

    def unreferenced(self) -> list[tuple[str, int]]:
        """Blocks no checkpoint references, least recently used first: (key, size)."""
        ...

    def forget_blocks(self, keys: Iterable[str]) -> list[str]:
        """Forget those of these blocks that no checkpoint references and no save claimed
        within the grace period (now, atomically); returns them: only those may be deleted
        from the block store, and `deleted_blocks` is called once they are."""
        ...

    def claim_blocks(self, keys: Sequence[str]) -> Claim:
        """Claim a save's blocks before it writes or relies on them: neither `forget_blocks`
        nor the collector takes them while the claim is fresh (shared catalogs)."""
        ...

    def doomed_blocks(self, limit: int) -> list[str]:
        """The collector's pass (shared catalogs): up to `limit` blocks that saves claimed
        longer than the grace period ago and no committed checkpoint knows, marked as
        being deleted; the caller deletes them from the store, then `deleted_blocks`."""
        ...

    def deleted_blocks(self, keys: Sequence[str]) -> None:
        """These blocks' deletion from the store is over (done, or given up)."""
        ...

    def block_bytes(self) -> int:
        """Bytes of the blocks the catalog records (what a remote store is counted as)."""
        ...

    def known_blocks(self) -> set[str]: ...

    def ping(self) -> None:
        """One round trip to the catalog (CatalogUnavailable when it cannot be reached)."""
        ...

    def take_lease(self, session_id: str, holder: str, ttl_ms: int) -> Lease:
        """Take (or extend, for its holder) the session's lease; a new holder gets a new,
        larger fencing token. Refused, the session is marked wanted for its holder."""
        ...

    def renew_leases(self, holder: str, leases: dict[str, int], ttl_ms: int) -> tuple[set[str], set[str]]:
        """Extend these leases (session id -> token); returns the sessions whose lease the
        holder no longer has, and those another daemon asked for since (take_lease)."""
        ...

    def release_lease(self, session_id: str, holder: str, token: int) -> None:
        """Let the lease go, if it is still this holder's."""
        ...
