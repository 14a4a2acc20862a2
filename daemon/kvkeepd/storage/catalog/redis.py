"""The catalog on a Redis (or Valkey) server, shared by several daemons.

It holds what the sqlite catalog holds — persistent sessions and their heads, checkpoints
with their manifests, block references, tenants' checkpoints — plus each session's lease.
Every write is one Lua script (redis_scripts.py), which the server runs atomically: a
checkpoint, its references and a head move commit together or not at all, and a head moves
only while the writer's fencing token is the session's newest (a daemon that lost its lease
never writes that head again). Scripts are idempotent where a client retries them (a
checkpoint id already committed is not committed twice).

Keys all begin with the deployment's prefix (`redis://host:port/db?prefix=NAME`, default
`kvkeep`), so deployments can share a server. The scripts name keys they derive, so the
catalog needs one server (or a primary), not a cluster:

    P:session:SID        hash: created_at, head, tenant
    P:sessions           zset: SID by created_at
    P:sessions-used      zset: SID by its head's save (expiry reads it)
    P:tenant-sessions:T  zset: the tenant's SIDs by their head's save (listings read it)
    P:index-version      set once the two above index every session
    P:ckpt:CID           hash: the row's fields and the manifest (and a stored response's
                         record)
    P:responses          zset: stored responses' CIDs by creation (expiry reads it)
    P:tenant-responses:T zset: the tenant's stored responses' CIDs by creation (listings)
    P:responses-indexed  set once the one above indexes every stored response
    P:prefixes           zset: kept prefixes' CIDs by the time they expire (expiry reads it)
    P:ckpts:SID          set: the session's checkpoint ids
    P:tenant:TENANT      set: the tenant's explicit and imported checkpoint ids
    P:tenant-all:TENANT  set: all the tenant's checkpoint ids (heads too: stored bytes)
    P:explicit           hash: SID -> explicit checkpoints
    P:refs:CID           set: the checkpoint's block keys
    P:blocks             hash: block key -> size
    P:block-refs         hash: block key -> checkpoints referencing it
    P:block-used         zset: block key by last use
    P:block-bytes        counter: bytes of the blocks in P:blocks
    P:claims             zset: block key by when a save last claimed it (server time)
    P:deleting           hash: block key -> when its deletion from the store was decided
    P:turn:SID           hash: the session's newest turn record (body), its n_tokens and
                         time; deleted when a head covers it (shared_journal.py)
    P:lease:SID          string "HOLDER|TOKEN" with an expiry
    P:fence:SID          counter: the session's newest fencing token
    P:want:SID           set while another daemon asks for a leased session
    P:store-key-id       which store key the deployment's manifests are signed with
    P:reserved:T         hash: the tenant's saves under way -> the bytes each reserved
    P:reserved-until:T   zset: those reservations by when they lapse (server time)

A server that cannot be reached (or does not answer within the socket timeout) makes the
call CatalogUnavailable (UNAVAILABLE); redis-py connects again on the next call, so service
resumes by itself when the server is back.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvkeepd.errors import CatalogUnavailable, SessionElsewhere, StaleClaim, StoreReadFailed
from kvkeepd.storage.catalog import (
    RECORD_HEAD,
    CheckpointRow,
    Claim,
    Lease,
    ListedSession,
    Reservation,
    SessionRow,
)
from kvkeepd.storage.catalog import redis_scripts as scripts
from kvkeepd.urls import catalog_url, redacted

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a call waits for the server before it counts as unreachable.
SOCKET_TIMEOUT = 2.0
#: Seconds a save's claim on its blocks holds, unless told otherwise (--orphan-grace).
DEFAULT_GRACE = 900.0
#: Seconds after which a block's deleting mark no longer holds claims off: its deleter died
#: between deciding and deleting (a live one gives up deleting long before; collector.py).
DELETING_STALE = 60.0
_FIELDS = (
    "session_id",
    "label",
    "kind",
    "n_tokens",
    "bytes_written",
    "bytes_referenced",
    "created_at",
    "tenant",
)


def _str(value: Any) -> str:
    """A server's answer (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)  # repr: a float read back exactly


class RedisCatalog:
    """The Catalog protocol on a Redis or Valkey server (see the module docstring)."""

    shared = True

    def __init__(self, url: str, grace: float = DEFAULT_GRACE) -> None:
        """`grace`: seconds a save's claim on its blocks holds (collector.py): longer than
        any save, the same on every daemon of the deployment."""
        target, self.prefix = catalog_url(url)
        self.grace = grace
        self.where = redacted(url)
        # A few quick retries ride out a reconnect; beyond them the call is UNAVAILABLE
        # (a request waits at most a few socket timeouts, never forever).
        self._db = redis.Redis.from_url(
            target,
            socket_timeout=SOCKET_TIMEOUT,
            socket_connect_timeout=SOCKET_TIMEOUT,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            health_check_interval=30,
        )
        self._add = self._db.register_script(scripts.ADD)
        self._delete_one = self._db.register_script(scripts.DELETE_ONE)
        self._delete_session = self._db.register_script(scripts.DELETE_SESSION)
        self._forget = self._db.register_script(scripts.FORGET)
        self._claim = self._db.register_script(scripts.CLAIM)
        self._doom = self._db.register_script(scripts.DOOM)
        self._done = self._db.register_script(scripts.DONE)
        self._take = self._db.register_script(scripts.TAKE)
        self._renew = self._db.register_script(scripts.RENEW)
        self._release = self._db.register_script(scripts.RELEASE)
        self._expire = self._db.register_script(scripts.EXPIRE)
        self._list = self._db.register_script(scripts.LIST)
        self._append_turns = self._db.register_script(scripts.APPEND_TURNS)
        self._reserve = self._db.register_script(scripts.RESERVE)
        self._stored = self._db.register_script(scripts.STORED)
        self._release_stored = self._db.register_script(scripts.RELEASE_STORED)
        self._list_responses = self._db.register_script(scripts.LIST_RESPONSES)
        self._manifest_bytes = 0
        self._call(self._db.ping)  # a server that cannot be reached stops the daemon's start
        # A catalog written before the session indexes existed gets them, once.
        self._call(self._db.register_script(scripts.INDEX), args=[self.prefix])
        self._call(self._db.register_script(scripts.INDEX_RESPONSES), args=[self.prefix])

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One call to the server; unreachable: CatalogUnavailable; refused: StoreReadFailed."""
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.error("the catalog server %s cannot be reached: %s", self.where, e)
            raise CatalogUnavailable(
                "the catalog server cannot be reached; try again (nothing was changed)"
            ) from None
        except redis.RedisError as e:
            log.error("the catalog server %s refused a command: %s", self.where, e)
            raise StoreReadFailed("the catalog server refused a command (see the daemon's log)") from None

    # ---- sizes ---------------------------------------------------------------------------

    @property
    def manifest_bytes(self) -> int:
        # Manifests live on the server: what a daemon's RAM budget counts is not there.
        return self._manifest_bytes

    def file_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self._db.close()

    def store_key_id(self, key_id: str) -> str:
        """The deployment's store key id: the first daemon's is kept; a daemon whose key
        differs cannot read the others' manifests, and is told so at start."""
        self._call(self._db.set, self._k("store-key-id"), key_id, nx=True)
        found = self._call(self._db.get, self._k("store-key-id"))
        return _str(found)

    # ---- checkpoints ---------------------------------------------------------------------

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
        args: list[Any] = [self.prefix, row.checkpoint_id, manifest, repr(now), head_of or "", str(fence)]
        args += [repr(claimed_at), repr(self.grace)]
        args += [_text(getattr(row, f)) for f in _FIELDS]
        args += [response if response is not None else b"", reservation]
        for key, size in blocks:
            args += [key, str(size)]
        found = self._call(self._add, args=args)
        if found[0] == b"fenced":
            raise SessionElsewhere(f"session {head_of} was taken over by another daemon; it continues there")
        if found[0] == b"stale":
            raise StaleClaim(
                f"the save took longer than the orphan grace period ({self.grace:g} s): nothing was saved"
            )
        return _str(found[1]) or None

    @staticmethod
    def _row(checkpoint_id: str, found: list[Any]) -> CheckpointRow:
        text = [_str(v) for v in found]
        return CheckpointRow(
            checkpoint_id=checkpoint_id,
            session_id=text[0],
            label=text[1],
            kind=text[2],
            n_tokens=int(text[3]),
            bytes_written=int(text[4]),
            bytes_referenced=int(text[5]),
            created_at=float(text[6]),
            tenant=text[7],
        )

    def get(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes] | None:
        found: list[Any] = self._call(self._db.hmget, self._k("ckpt", checkpoint_id), [*_FIELDS, "manifest"])
        if found[0] is None:
            return None
        manifest: bytes = found[-1]
        return self._row(checkpoint_id, found[:-1]), bytes(manifest)

    def response(self, checkpoint_id: str) -> tuple[CheckpointRow, bytes] | None:
        found: list[Any] = self._call(self._db.hmget, self._k("ckpt", checkpoint_id), [*_FIELDS, "response"])
        if found[0] is None or found[-1] is None:
            return None
        record: bytes = found[-1]
        return self._row(checkpoint_id, found[:-1]), bytes(record)

    def old_responses(self, created_before: float, limit: int) -> list[str]:
        found = self._call(
            self._db.zrangebyscore, self._k("responses"), "-inf", f"({created_before!r}", start=0, num=limit
        )
        return [_str(cid) for cid in found]

    def expired_prefixes(self, now: float, limit: int) -> list[str]:
        found = self._call(
            self._db.zrangebyscore, self._k("prefixes"), "-inf", f"({now!r}", start=0, num=limit
        )
        return [_str(cid) for cid in found]

    def _rows(self, ids: Iterable[Any]) -> list[CheckpointRow]:
        names = [_str(i) for i in ids]
        pipe = self._db.pipeline(transaction=False)
        for cid in names:
            pipe.hmget(self._k("ckpt", cid), list(_FIELDS))
        found = self._call(pipe.execute)
        rows = [self._row(cid, f) for cid, f in zip(names, found, strict=True) if f[0] is not None]
        return sorted(rows, key=lambda r: r.created_at)

    def checkpoints(self, session_id: str, include_heads: bool = False) -> list[CheckpointRow]:
        kinds = ("explicit", "head") if include_heads else ("explicit",)
        ids = self._call(self._db.smembers, self._k("ckpts", session_id))
        return [r for r in self._rows(ids) if r.kind in kinds]

    def tenant_checkpoints(self, tenant: str) -> list[CheckpointRow]:
        return self._rows(self._call(self._db.smembers, self._k("tenant", tenant)))

    def tenant_responses(
        self, tenant: str, after: str, limit: int, descending: bool
    ) -> list[tuple[CheckpointRow, bytes]] | None:
        args = [self.prefix, tenant, after, str(limit), "1" if descending else "0", str(RECORD_HEAD)]
        found = self._call(self._list_responses, args=args)
        if not int(found[0]):
            return None
        return [(self._row(_str(f[0]), f[1:9]), bytes(f[9])) for f in found[1:]]

    def stored_bytes(self, tenant: str) -> int:
        return int(self._call(self._stored, args=[self.prefix, tenant]))

    def reserve_stored(
        self, tenant: str, blocks: Sequence[tuple[str, int]], own: int, limit: int
    ) -> Reservation:
        reservation_id = secrets.token_hex(12)
        args: list[Any] = [self.prefix, tenant, reservation_id, str(limit), str(own), repr(self.grace)]
        for key, most in blocks:
            args += [key, str(most)]
        granted, held, needed = self._call(self._reserve, args=args)
        return Reservation(_str(granted), int(held), int(needed))

    def release_stored(self, tenant: str, reservation_id: str) -> None:
        self._call(self._release_stored, args=[self.prefix, tenant, reservation_id])

    def delete(self, checkpoint_id: str) -> bool:
        return bool(self._call(self._delete_one, args=[self.prefix, checkpoint_id]))

    def delete_session(self, session_id: str, fence: int = 0) -> None:
        if not self._call(self._delete_session, args=[self.prefix, session_id, str(fence)]):
            raise SessionElsewhere(f"session {session_id} was taken over by another daemon")

    # ---- sessions ------------------------------------------------------------------------

    def sessions(self) -> list[tuple[str, float, str | None]]:
        ids = [_str(i) for i in self._call(self._db.zrange, self._k("sessions"), 0, -1)]
        pipe = self._db.pipeline(transaction=False)
        for sid in ids:
            pipe.hmget(self._k("session", sid), ["created_at", "head"])
        found = self._call(pipe.execute) if ids else []
        return [
            (sid, float(f[0]), _str(f[1]) if f[1] else None)
            for sid, f in zip(ids, found, strict=True)
            if f[0] is not None
        ]

    def session(self, session_id: str) -> SessionRow | None:
        found = self._call(self._db.hmget, self._k("session", session_id), ["created_at", "head", "tenant"])
        if found[0] is None:
            return None
        return SessionRow(float(found[0]), _str(found[1]) if found[1] else None, _str(found[2] or b""))

    def tenant_sessions(self, tenant: str, limit: int) -> list[ListedSession]:
        found = self._call(self._list, args=[self.prefix, tenant, str(limit)])
        rows = [[_str(v) for v in f] for f in found]
        return [ListedSession(r[0], float(r[1]), float(r[2]), r[3], int(r[4]), int(r[5]), r[6]) for r in rows]

    def expire_sessions(self, idle_before: float, limit: int) -> list[str]:
        found = self._call(self._expire, args=[self.prefix, repr(idle_before), str(limit)])
        return [_str(sid) for sid in found]

    def counts(self, session_ids: Sequence[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(session_ids))
        if not ids:
            return {}
        values = self._call(self._db.hmget, self._k("explicit"), ids)
        return {sid: int(v) for sid, v in zip(ids, values, strict=True) if v is not None and int(v)}

    # ---- turn records (the shared journal) -------------------------------------------------

    def append_turns(self, records: Sequence[tuple[str, int, int, bytes]], now: float) -> list[bool]:
        """Make each (session id, fence, n_tokens, body) its session's turn record, in one
        script (one round trip; the server's append-only log makes it durable before it
        answers); per record whether it was kept (not: fenced, or the session is gone)."""
        args: list[Any] = [self.prefix, repr(now)]
        for session_id, fence, n_tokens, body in records:
            args += [session_id, str(fence), str(n_tokens), body]
        return [bool(int(kept)) for kept in self._call(self._append_turns, args=args)]

    def turn(self, session_id: str) -> bytes | None:
        """The session's newest turn record since its head, or None."""
        found = self._call(self._db.hget, self._k("turn", session_id), "body")
        return found if isinstance(found, bytes) or found is None else found.encode()

    def durability(self) -> dict[str, str]:
        """The server's persistence settings (appendonly, appendfsync), as far as it tells
        ({} if CONFIG is refused, as managed servers may)."""
        try:
            found = self._db.config_get("append*")
        except redis.RedisError:
            return {}
        return {_str(k): _str(v) for k, v in found.items()}

    # ---- blocks --------------------------------------------------------------------------

    def touch(self, keys: Iterable[str], now: float) -> None:
        mapping = {k: now for k in keys}
        if mapping:
            self._call(self._db.zadd, self._k("block-used"), mapping, xx=True)

    def present(self, keys: list[str]) -> set[str]:
        if not keys:
            return set()
        sizes = self._call(self._db.hmget, self._k("blocks"), keys)
        return {k for k, s in zip(keys, sizes, strict=True) if s is not None}

    def block_size(self, key: str) -> int | None:
        found = self._call(self._db.hget, self._k("blocks"), key)
        return None if found is None else int(found)

    def unreferenced(self) -> list[tuple[str, int]]:
        keys = [_str(k) for k in self._call(self._db.zrange, self._k("block-used"), 0, -1)]
        if not keys:
            return []
        refs = self._call(self._db.hmget, self._k("block-refs"), keys)
        sizes = self._call(self._db.hmget, self._k("blocks"), keys)
        return [
            (k, int(s))
            for k, r, s in zip(keys, refs, sizes, strict=True)
            if s is not None and int(r or 0) <= 0
        ]

    def forget_blocks(self, keys: Iterable[str]) -> list[str]:
        wanted = list(keys)
        if not wanted:
            return []
        return [_str(k) for k in self._call(self._forget, args=[self.prefix, repr(self.grace), *wanted])]

    def claim_blocks(self, keys: Sequence[str]) -> Claim:
        if not keys:
            return Claim({}, set())
        at, sizes, busy = self._call(self._claim, args=[self.prefix, repr(DELETING_STALE), *keys])
        known = {k: int(v) for k, v in zip(keys, sizes, strict=True) if v}
        return Claim(known, {_str(b) for b in busy}, float(at))

    def doomed_blocks(self, limit: int) -> list[str]:
        return [_str(k) for k in self._call(self._doom, args=[self.prefix, repr(self.grace), str(limit)])]

    def deleted_blocks(self, keys: Sequence[str]) -> None:
        if keys:
            self._call(self._done, args=[self.prefix, *keys])

    def block_bytes(self) -> int:
        return int(self._call(self._db.get, self._k("block-bytes")) or 0)

    def known_blocks(self) -> set[str]:
        return {_str(k) for k in self._call(self._db.hkeys, self._k("blocks"))}

    # ---- leases --------------------------------------------------------------------------

    def ping(self) -> None:
        self._call(self._db.ping)

    def take_lease(self, session_id: str, holder: str, ttl_ms: int) -> Lease:
        token, wait = self._call(
            self._take,
            keys=[self._k("lease", session_id), self._k("fence", session_id), self._k("want", session_id)],
            args=[holder, ttl_ms],
        )
        return Lease(int(token), max(0, int(wait)))

    def renew_leases(self, holder: str, leases: dict[str, int], ttl_ms: int) -> tuple[set[str], set[str]]:
        if not leases:
            return set(), set()
        pipe = self._db.pipeline(transaction=False)
        order = list(leases.items())
        for sid, token in order:
            self._renew(
                keys=[self._k("lease", sid), self._k("want", sid)],
                args=[f"{holder}|{token}", ttl_ms],
                client=pipe,
            )
        found = self._call(pipe.execute)
        lost = {sid for (sid, _), answer in zip(order, found, strict=True) if int(answer) == 0}
        wanted = {sid for (sid, _), answer in zip(order, found, strict=True) if int(answer) == 2}
        return lost, wanted

    def release_lease(self, session_id: str, holder: str, token: int) -> None:
        self._call(
            self._release,
            keys=[self._k("lease", session_id), self._k("want", session_id)],
            args=[f"{holder}|{token}"],
        )
