"""The catalog on a Redis (or Valkey) server, shared by several daemons.

It holds what the sqlite catalog holds — persistent sessions and their heads, checkpoints
with their manifests, block references, tenants' checkpoints — plus each session's lease.
Every write is one Lua script, which the server runs atomically: a checkpoint, its
references and a head move commit together or not at all, and a head moves only while the
writer's fencing token is the session's newest (a daemon that lost its lease never writes
that head again). Scripts are idempotent where a client retries them (a checkpoint id
already committed is not committed twice).

Keys all begin with the deployment's prefix (`redis://host:port/db?prefix=NAME`, default
`kvstash`), so deployments can share a server. The scripts name keys they derive, so the
catalog needs one server (or a primary), not a cluster:

    P:session:SID        hash: created_at, head, tenant
    P:sessions           zset: SID by created_at
    P:ckpt:CID           hash: the row's fields and the manifest
    P:ckpts:SID          set: the session's checkpoint ids
    P:tenant:TENANT      set: the tenant's explicit and imported checkpoint ids
    P:tenant-all:TENANT  set: all the tenant's checkpoint ids (heads too: stored bytes)
    P:explicit           hash: SID -> explicit checkpoints
    P:refs:CID           set: the checkpoint's block keys
    P:blocks             hash: block key -> size
    P:block-refs         hash: block key -> checkpoints referencing it
    P:block-used         zset: block key by last use
    P:block-bytes        counter: bytes of the blocks in P:blocks
    P:lease:SID          string "HOLDER|TOKEN" with an expiry
    P:fence:SID          counter: the session's newest fencing token
    P:want:SID           set while another daemon asks for a leased session
    P:store-key-id       which store key the deployment's manifests are signed with

A server that cannot be reached (or does not answer within the socket timeout) makes the
call CatalogUnavailable (UNAVAILABLE); redis-py connects again on the next call, so service
resumes by itself when the server is back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvstashd.catalog import CheckpointRow, Lease, SessionRow
from kvstashd.config import catalog_url
from kvstashd.errors import CatalogUnavailable, SessionElsewhere, StoreReadFailed
from kvstashd.store import redacted

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a call waits for the server before it counts as unreachable.
SOCKET_TIMEOUT = 2.0
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

# Deletes one checkpoint and its references (a local function of the scripts below).
_DELETE = """
local function delete_ckpt(P, cid)
  local ck = P .. ':ckpt:' .. cid
  if redis.call('EXISTS', ck) == 0 then return 0 end
  local f = redis.call('HMGET', ck, 'session_id', 'tenant', 'kind', 'manifest')
  for _, b in ipairs(redis.call('SMEMBERS', P .. ':refs:' .. cid)) do
    if redis.call('HINCRBY', P .. ':block-refs', b, -1) <= 0 then
      redis.call('HDEL', P .. ':block-refs', b)
    end
  end
  redis.call('DEL', P .. ':refs:' .. cid, ck)
  redis.call('SREM', P .. ':ckpts:' .. f[1], cid)
  redis.call('SREM', P .. ':tenant:' .. f[2], cid)
  redis.call('SREM', P .. ':tenant-all:' .. f[2], cid)
  if f[3] == 'explicit' then
    if redis.call('HINCRBY', P .. ':explicit', f[1], -1) <= 0 then
      redis.call('HDEL', P .. ':explicit', f[1])
    end
  end
  redis.call('DECRBY', P .. ':manifest-bytes', string.len(f[4]))
  return 1
end
local function fenced(P, sid, fence)
  if fence == '0' then return false end
  return (redis.call('GET', P .. ':fence:' .. sid) or '0') ~= fence
end
"""

# ARGV: prefix, cid, manifest, now, head_of, fence, then the row's fields (_FIELDS), then
# block key and size pairs. Returns {'ok', old head or ''} or {'fenced'}.
_ADD = (
    _DELETE
    + """
local P, cid, manifest, now, head_of, fence = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local sid, label, kind, n_tokens, written, referenced, created_at, tenant =
  ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14]
local ck = P .. ':ckpt:' .. cid
if redis.call('EXISTS', ck) == 1 then return {'ok', ''} end
if head_of ~= '' and fenced(P, head_of, fence) then return {'fenced'} end
redis.call('HSET', ck, 'session_id', sid, 'label', label, 'kind', kind, 'n_tokens', n_tokens,
  'bytes_written', written, 'bytes_referenced', referenced, 'created_at', created_at,
  'tenant', tenant, 'manifest', manifest)
redis.call('SADD', P .. ':ckpts:' .. sid, cid)
redis.call('SADD', P .. ':tenant-all:' .. tenant, cid)
if kind == 'explicit' or kind == 'imported' then redis.call('SADD', P .. ':tenant:' .. tenant, cid) end
if kind == 'explicit' then redis.call('HINCRBY', P .. ':explicit', sid, 1) end
redis.call('INCRBY', P .. ':manifest-bytes', string.len(manifest))
for i = 15, #ARGV, 2 do
  local b = ARGV[i]
  if redis.call('HSETNX', P .. ':blocks', b, ARGV[i + 1]) == 1 then
    redis.call('INCRBY', P .. ':block-bytes', ARGV[i + 1])
  end
  redis.call('ZADD', P .. ':block-used', now, b)
  if redis.call('SADD', P .. ':refs:' .. cid, b) == 1 then redis.call('HINCRBY', P .. ':block-refs', b, 1) end
end
local old = ''
if head_of ~= '' then
  local s = P .. ':session:' .. head_of
  old = redis.call('HGET', s, 'head') or ''
  if redis.call('EXISTS', s) == 0 then
    redis.call('HSET', s, 'created_at', created_at, 'tenant', tenant)
    redis.call('ZADD', P .. ':sessions', created_at, head_of)
  end
  redis.call('HSET', s, 'head', cid)
  if old ~= '' then delete_ckpt(P, old) end
end
return {'ok', old}
"""
)

# ARGV: prefix, cid. Returns 1 if it existed.
_DELETE_ONE = (
    _DELETE
    + """
local P, cid = ARGV[1], ARGV[2]
local sid = redis.call('HGET', P .. ':ckpt:' .. cid, 'session_id')
if sid and redis.call('HGET', P .. ':session:' .. sid, 'head') == cid then
  redis.call('HDEL', P .. ':session:' .. sid, 'head')
end
return delete_ckpt(P, cid)
"""
)

# ARGV: prefix, sid, fence. Returns 1, or 0 when fenced.
_DELETE_SESSION = (
    _DELETE
    + """
local P, sid, fence = ARGV[1], ARGV[2], ARGV[3]
if fenced(P, sid, fence) then return 0 end
for _, cid in ipairs(redis.call('SMEMBERS', P .. ':ckpts:' .. sid)) do delete_ckpt(P, cid) end
redis.call('DEL', P .. ':session:' .. sid, P .. ':ckpts:' .. sid, P .. ':lease:' .. sid, P .. ':want:' .. sid)
redis.call('ZREM', P .. ':sessions', sid)
redis.call('HDEL', P .. ':explicit', sid)
return 1
"""
)

# ARGV: prefix, then block keys. Forgets those no checkpoint references; returns them.
_FORGET = """
local P = ARGV[1]
local out = {}
for i = 2, #ARGV do
  local b = ARGV[i]
  if tonumber(redis.call('HGET', P .. ':block-refs', b) or '0') <= 0 then
    local size = redis.call('HGET', P .. ':blocks', b)
    if size then
      redis.call('HDEL', P .. ':blocks', b)
      redis.call('DECRBY', P .. ':block-bytes', size)
      table.insert(out, b)
    end
    redis.call('ZREM', P .. ':block-used', b)
  end
end
return out
"""

# KEYS: lease, fence, want. ARGV: holder, ttl_ms. Returns {token, 0}, or {0, ms the holder
# keeps it} after marking the session wanted.
_TAKE = """
local v = redis.call('GET', KEYS[1])
if v then
  local h, t = string.match(v, '^(.*)|(%d+)$')
  if h == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {tonumber(t), 0}
  end
  redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
  return {0, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. t, 'PX', ARGV[2])
redis.call('DEL', KEYS[3])
return {t, 0}
"""

# KEYS: lease, want. ARGV: "holder|token", ttl_ms. Returns 0: lost; 1: renewed; 2: renewed,
# and another daemon asks for it.
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1 + redis.call('EXISTS', KEYS[2])
"""

# KEYS: lease, want. ARGV: "holder|token".
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1], KEYS[2]) end
return 0
"""


def _str(value: Any) -> str:
    """A server's answer (bytes) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)  # repr: a float read back exactly


class RedisCatalog:
    """The Catalog protocol on a Redis or Valkey server (see the module docstring)."""

    shared = True

    def __init__(self, url: str) -> None:
        target, self.prefix = catalog_url(url)
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
        self._add = self._db.register_script(_ADD)
        self._delete_one = self._db.register_script(_DELETE_ONE)
        self._delete_session = self._db.register_script(_DELETE_SESSION)
        self._forget = self._db.register_script(_FORGET)
        self._take = self._db.register_script(_TAKE)
        self._renew = self._db.register_script(_RENEW)
        self._release = self._db.register_script(_RELEASE)
        self._manifest_bytes = 0
        self._call(self._db.ping)  # a server that cannot be reached stops the daemon's start

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
    ) -> str | None:
        args: list[Any] = [self.prefix, row.checkpoint_id, manifest, repr(now), head_of or "", str(fence)]
        args += [_text(getattr(row, f)) for f in _FIELDS]
        for key, size in blocks:
            args += [key, str(size)]
        found = self._call(self._add, args=args)
        if found[0] == b"fenced":
            raise SessionElsewhere(f"session {head_of} was taken over by another daemon; it continues there")
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

    def stored_bytes(self, tenant: str) -> int:
        ids = [_str(i) for i in self._call(self._db.smembers, self._k("tenant-all", tenant))]
        if not ids:
            return 0
        keys = self._call(self._db.sunion, [self._k("refs", cid) for cid in ids])
        if not keys:
            return 0
        sizes = self._call(self._db.hmget, self._k("blocks"), list(keys))
        return sum(int(s) for s in sizes if s is not None)

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

    def counts(self) -> dict[str, int]:
        found = self._call(self._db.hgetall, self._k("explicit"))
        return {_str(k): int(v) for k, v in found.items()}

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
        return [_str(k) for k in self._call(self._forget, args=[self.prefix, *wanted])]

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
