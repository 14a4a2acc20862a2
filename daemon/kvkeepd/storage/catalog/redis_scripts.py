"""The Lua scripts the Redis catalog (catalog/redis.py) runs for every write.

The server runs each script atomically, so a checkpoint, its references and a head move
commit together or not at all, and a head moves only while the writer's fencing token is
the session's newest. Scripts are idempotent where a client retries them (a checkpoint id
already committed is not committed twice). They derive the keys they touch from the
deployment's prefix (ARGV[1]) as catalog/redis.py's docstring lists them, or are given them
(KEYS).
"""

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
  redis.call('ZREM', P .. ':responses', cid)
  redis.call('ZREM', P .. ':tenant-responses:' .. f[2], cid)
  redis.call('ZREM', P .. ':prefixes', cid)
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
local function forget_session(P, sid)
  local tenant = redis.call('HGET', P .. ':session:' .. sid, 'tenant') or ''
  for _, cid in ipairs(redis.call('SMEMBERS', P .. ':ckpts:' .. sid)) do delete_ckpt(P, cid) end
  redis.call('DEL', P .. ':session:' .. sid, P .. ':ckpts:' .. sid, P .. ':turn:' .. sid)
  redis.call('DEL', P .. ':lease:' .. sid, P .. ':want:' .. sid)
  redis.call('ZREM', P .. ':sessions', sid)
  redis.call('ZREM', P .. ':sessions-used', sid)
  redis.call('ZREM', P .. ':tenant-sessions:' .. tenant, sid)
  redis.call('HDEL', P .. ':explicit', sid)
end
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fenced(P, sid, fence)
  if fence == '0' then return false end
  return (redis.call('GET', P .. ':fence:' .. sid) or '0') ~= fence
end
"""

# A tenant's stored bytes and the saves' reservations of its quota (RESERVE):
# `P:reserved:T` (hash: reservation id -> bytes) and `P:reserved-until:T` (zset: reservation
# id -> when it lapses, by the server's clock).
_QUOTA = """
local function tenant_stored(P, tenant)
  local seen, total = {}, 0
  for _, cid in ipairs(redis.call('SMEMBERS', P .. ':tenant-all:' .. tenant)) do
    local ck = P .. ':ckpt:' .. cid
    total = total + redis.call('HSTRLEN', ck, 'manifest') + redis.call('HSTRLEN', ck, 'response')
    for _, b in ipairs(redis.call('SMEMBERS', P .. ':refs:' .. cid)) do
      if not seen[b] then
        seen[b] = true
        total = total + tonumber(redis.call('HGET', P .. ':blocks', b) or '0')
      end
    end
  end
  return total, seen
end
local function take_reservation(P, tenant, rid)
  if rid == '' then return true end
  redis.call('ZREM', P .. ':reserved-until:' .. tenant, rid)
  return redis.call('HDEL', P .. ':reserved:' .. tenant, rid) == 1
end
"""

# ARGV: prefix, tenant, reservation id, limit, own bytes, seconds it holds, then block key and
# most-bytes pairs. Reserves what the save may add to the tenant's stored bytes (the blocks
# none of its checkpoints references, at the catalog's size where known, and its own bytes)
# if that, what the tenant stores and its live reservations fit the limit. Returns {the id,
# or '' if refused, held bytes, needed bytes}.
RESERVE = (
    _DELETE
    + _QUOTA
    + """
local P, tenant, rid, limit, own, hold = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local held_key, until_key = P .. ':reserved:' .. tenant, P .. ':reserved-until:' .. tenant
local now = server_now()
for _, lapsed in ipairs(redis.call('ZRANGEBYSCORE', until_key, '-inf', now)) do
  take_reservation(P, tenant, lapsed)
end
local held, seen = tenant_stored(P, tenant)
for _, n in ipairs(redis.call('HVALS', held_key)) do held = held + tonumber(n) end
local needed = own
for i = 7, #ARGV, 2 do
  local b = ARGV[i]
  if not seen[b] then
    seen[b] = true
    needed = needed + tonumber(redis.call('HGET', P .. ':blocks', b) or ARGV[i + 1])
  end
end
if held + needed > limit then return {'', held, needed} end
redis.call('HSET', held_key, rid, needed)
redis.call('ZADD', until_key, now + hold, rid)
return {rid, held, needed}
"""
)

# ARGV: prefix, tenant. The tenant's stored bytes.
STORED = (
    _QUOTA
    + """
return (tenant_stored(ARGV[1], ARGV[2]))
"""
)

# ARGV: prefix, tenant, reservation id. Lets the reservation go.
RELEASE_STORED = (
    _QUOTA
    + """
take_reservation(ARGV[1], ARGV[2], ARGV[3])
return 0
"""
)

# ARGV: prefix, cid, manifest, now, head_of, fence, claimed_at, grace, then the row's fields
# (in the order of redis_catalog._FIELDS), a stored response's record ('' for none), the
# save's reservation of its tenant's quota ('' for none: RESERVE), then block key and size
# pairs. Returns {'ok', old head or ''}, {'fenced'}, or {'stale'} when its blocks were claimed
# (CLAIM) more than `grace` seconds ago by the server's clock (the collector may have taken
# them for orphans) or its reservation lapsed; the reservation goes with the commit.
ADD = (
    _DELETE
    + _QUOTA
    + """
local P, cid, manifest, now, head_of, fence = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local claimed_at, grace = tonumber(ARGV[7]), tonumber(ARGV[8])
local sid, label, kind, n_tokens, written, referenced, created_at, tenant, response =
  ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13], ARGV[14], ARGV[15], ARGV[16], ARGV[17]
local ck = P .. ':ckpt:' .. cid
if redis.call('EXISTS', ck) == 1 then return {'ok', ''} end
if head_of ~= '' and fenced(P, head_of, fence) then return {'fenced'} end
if claimed_at > 0 and server_now() - claimed_at > grace then return {'stale'} end
if not take_reservation(P, tenant, ARGV[18]) then return {'stale'} end
redis.call('HSET', ck, 'session_id', sid, 'label', label, 'kind', kind, 'n_tokens', n_tokens,
  'bytes_written', written, 'bytes_referenced', referenced, 'created_at', created_at,
  'tenant', tenant, 'manifest', manifest)
redis.call('SADD', P .. ':ckpts:' .. sid, cid)
redis.call('SADD', P .. ':tenant-all:' .. tenant, cid)
if kind == 'explicit' or kind == 'imported' then redis.call('SADD', P .. ':tenant:' .. tenant, cid) end
if kind == 'explicit' then redis.call('HINCRBY', P .. ':explicit', sid, 1) end
if kind == 'prefix' then redis.call('ZADD', P .. ':prefixes', created_at + tonumber(label), cid) end
redis.call('INCRBY', P .. ':manifest-bytes', string.len(manifest))
if response ~= '' then
  redis.call('HSET', ck, 'response', response)
  redis.call('ZADD', P .. ':responses', created_at, cid)
  redis.call('ZADD', P .. ':tenant-responses:' .. tenant, created_at, cid)
end
for i = 19, #ARGV, 2 do
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
  redis.call('DEL', P .. ':turn:' .. head_of)  -- the head covers the turns recorded since the last
  redis.call('ZADD', P .. ':sessions-used', now, head_of)
  redis.call('ZADD', P .. ':tenant-sessions:' .. (redis.call('HGET', s, 'tenant') or ''), now, head_of)
  if old ~= '' then delete_ckpt(P, old) end
end
return {'ok', old}
"""
)

# ARGV: prefix, cid. Returns 1 if it existed.
DELETE_ONE = (
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
DELETE_SESSION = (
    _DELETE
    + """
local P, sid, fence = ARGV[1], ARGV[2], ARGV[3]
if fenced(P, sid, fence) then return 0 end
forget_session(P, sid)
return 1
"""
)

# ARGV: prefix, idle_before, limit. Deletes up to `limit` sessions whose head was saved
# before idle_before and that have no live lease (nobody holds one or is taking it over:
# a take-over takes the lease first); their fencing token moves on, so a daemon whose lease
# lapsed cannot write their head again (and bring them back). Returns their ids.
EXPIRE = (
    _DELETE
    + """
local P, before, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for _, sid in ipairs(redis.call('ZRANGEBYSCORE', P .. ':sessions-used', '-inf', '(' .. before)) do
  if #out >= limit then break end
  if redis.call('EXISTS', P .. ':session:' .. sid) == 0 then
    redis.call('ZREM', P .. ':sessions-used', sid)  -- deleted by a daemon that kept no index
  elseif redis.call('EXISTS', P .. ':lease:' .. sid) == 0 then
    forget_session(P, sid)
    redis.call('INCR', P .. ':fence:' .. sid)
    table.insert(out, sid)
  end
end
return out
"""
)

# ARGV: prefix, tenant, limit. The tenant's `limit` most recently used sessions with a head:
# for each, id, created_at, last use (its head's save or its newest turn record), head, its
# n_tokens (the newest record's, else the head's), explicit checkpoints, and the daemon that
# holds its lease ('' if none does).
LIST = """
local P, tenant, limit = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
local found = redis.call('ZREVRANGE', P .. ':tenant-sessions:' .. tenant, 0, limit - 1, 'WITHSCORES')
for i = 1, #found, 2 do
  local sid, used = found[i], found[i + 1]
  local s = redis.call('HMGET', P .. ':session:' .. sid, 'created_at', 'head', 'tenant')
  if s[1] and s[2] and s[3] == tenant then
    local h = redis.call('HMGET', P .. ':ckpt:' .. s[2], 'n_tokens', 'created_at')
    if h[1] then
      local n = redis.call('HGET', P .. ':explicit', sid) or '0'
      local tokens = redis.call('HGET', P .. ':turn:' .. sid, 'n_tokens') or h[1]
      local lease = redis.call('GET', P .. ':lease:' .. sid) or ''
      local holder = string.match(lease, '^(.*)#[^#|]*|%d+$') or ''
      table.insert(out, {sid, s[1], used, s[2], tokens, n, holder})
    end
  end
end
return out
"""

# ARGV: prefix, tenant, after ('' for the first), limit, '1' for newest first (else oldest
# first), the bytes of a record to read. A page of the tenant's stored responses, by creation
# then id (a sorted set orders equal scores by member): {1, then per response its id, its
# row's fields (in the order of redis_catalog._FIELDS) and its record's first bytes}, or {0}
# when `after` is not one of them.
LIST_RESPONSES = """
local P, tenant, after, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local newest, head = ARGV[5] == '1', tonumber(ARGV[6])
local key = P .. ':tenant-responses:' .. tenant
local start = 0
if after ~= '' then
  local rank
  if newest then rank = redis.call('ZREVRANK', key, after) else rank = redis.call('ZRANK', key, after) end
  if not rank then return {0} end
  start = rank + 1
end
local ids
if newest then
  ids = redis.call('ZREVRANGE', key, start, start + limit - 1)
else
  ids = redis.call('ZRANGE', key, start, start + limit - 1)
end
local out = {1}
for _, cid in ipairs(ids) do
  local ck = P .. ':ckpt:' .. cid
  local f = redis.call('HMGET', ck, 'session_id', 'label', 'kind', 'n_tokens', 'bytes_written',
    'bytes_referenced', 'created_at', 'tenant', 'response')
  if f[1] and f[9] then
    f[9] = string.sub(f[9], 1, head)
    table.insert(f, 1, cid)
    table.insert(out, f)
  end
end
return out
"""

# ARGV: prefix. Indexes by tenant the stored responses of a catalog written before that index
# existed, once.
INDEX_RESPONSES = """
local P = ARGV[1]
if redis.call('GET', P .. ':responses-indexed') == '1' then return 0 end
local found = redis.call('ZRANGE', P .. ':responses', 0, -1, 'WITHSCORES')
for i = 1, #found, 2 do
  local tenant = redis.call('HGET', P .. ':ckpt:' .. found[i], 'tenant')
  if tenant then redis.call('ZADD', P .. ':tenant-responses:' .. tenant, found[i + 1], found[i]) end
end
redis.call('SET', P .. ':responses-indexed', '1')
return 1
"""

# ARGV: prefix, now, then per record: session id, fence, n_tokens, body. Makes each body its
# session's turn record (replacing the one before), if the session exists and its fencing
# token is still the writer's; the session counts as used now. Returns per record 1 (kept)
# or 0 (fenced, or the session is gone: nothing written).
APPEND_TURNS = (
    _DELETE
    + """
local P, now = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV, 4 do
  local sid, fence, n_tokens, body = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local s = P .. ':session:' .. sid
  if fenced(P, sid, fence) or redis.call('EXISTS', s) == 0 then
    table.insert(out, 0)
  else
    redis.call('HSET', P .. ':turn:' .. sid, 'body', body, 'n_tokens', n_tokens, 'at', now)
    redis.call('ZADD', P .. ':sessions-used', now, sid)
    redis.call('ZADD', P .. ':tenant-sessions:' .. (redis.call('HGET', s, 'tenant') or ''), now, sid)
    table.insert(out, 1)
  end
end
return out
"""
)

# ARGV: prefix. Indexes the sessions a catalog written before the indexes existed holds
# (by last use, overall and per tenant), once.
INDEX = """
local P = ARGV[1]
if redis.call('GET', P .. ':index-version') == '1' then return 0 end
for _, sid in ipairs(redis.call('ZRANGE', P .. ':sessions', 0, -1)) do
  local s = redis.call('HMGET', P .. ':session:' .. sid, 'created_at', 'head', 'tenant')
  if s[1] then
    local used = s[1]
    if s[2] then used = redis.call('HGET', P .. ':ckpt:' .. s[2], 'created_at') or s[1] end
    redis.call('ZADD', P .. ':sessions-used', used, sid)
    redis.call('ZADD', P .. ':tenant-sessions:' .. (s[3] or ''), used, sid)
  end
end
redis.call('SET', P .. ':index-version', '1')
return 1
"""

# Blocks a save may rely on and blocks being deleted (the collector's protocol; see
# storage/collector.py): `P:claims` (zset: block key -> when a save last claimed it, by the
# server's clock) and `P:deleting` (hash: block key -> when its deletion from the store was
# decided). A block claimed within the grace period is never forgotten or collected, and
# a claim waits while its block is being deleted.
_CLAIMS = """
local function claimed_since(P, b, since)
  return tonumber(redis.call('ZSCORE', P .. ':claims', b) or '0') > since
end
"""

# ARGV: prefix, grace, then block keys. Forgets those no checkpoint references and no save
# claimed within `grace` seconds, marking them deleting; returns them (the caller deletes
# them from the store, then calls DONE).
FORGET = (
    _DELETE
    + _CLAIMS
    + """
local P, grace = ARGV[1], tonumber(ARGV[2])
local now = server_now()
local out = {}
for i = 3, #ARGV do
  local b = ARGV[i]
  local unreferenced = tonumber(redis.call('HGET', P .. ':block-refs', b) or '0') <= 0
  if unreferenced and not claimed_since(P, b, now - grace) then
    local size = redis.call('HGET', P .. ':blocks', b)
    if size then
      redis.call('HDEL', P .. ':blocks', b)
      redis.call('DECRBY', P .. ':block-bytes', size)
      redis.call('HSET', P .. ':deleting', b, now)
      table.insert(out, b)
    end
    redis.call('ZREM', P .. ':block-used', b)
  end
end
return out
"""
)

# ARGV: prefix, stale (seconds after which a deleting mark is ignored: its deleter died),
# then block keys. Claims the blocks for a save: {now, sizes (the catalog's, '' if unknown)
# in order, then the keys being deleted}; nothing is claimed while any is being deleted.
CLAIM = (
    _DELETE
    + """
local P, stale = ARGV[1], tonumber(ARGV[2])
local now = server_now()
local busy = {}
for i = 3, #ARGV do
  local at = redis.call('HGET', P .. ':deleting', ARGV[i])
  if at and now - tonumber(at) < stale then table.insert(busy, ARGV[i]) end
end
local sizes = {}
for i = 3, #ARGV do
  if #busy == 0 then redis.call('ZADD', P .. ':claims', now, ARGV[i]) end
  table.insert(sizes, redis.call('HGET', P .. ':blocks', ARGV[i]) or '')
end
return {tostring(now), sizes, busy}
"""
)

# ARGV: prefix, grace, limit. The collector's pass: blocks a save claimed more than `grace`
# seconds ago that no committed checkpoint knows (what a save cut short left in the store)
# are marked deleting and returned, up to `limit`; older claims of known blocks are dropped.
DOOM = (
    _DELETE
    + """
local P, grace, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = server_now()
local out = {}
local old = redis.call('ZRANGEBYSCORE', P .. ':claims', '-inf', '(' .. (now - grace), 'LIMIT', 0, limit)
for _, b in ipairs(old) do
  redis.call('ZREM', P .. ':claims', b)
  if redis.call('HEXISTS', P .. ':blocks', b) == 0 then
    redis.call('HSET', P .. ':deleting', b, now)
    table.insert(out, b)
  end
end
return out
"""
)

# ARGV: prefix, then block keys deleted from the store (or not: given up). Clears their marks.
DONE = """
local P = ARGV[1]
for i = 2, #ARGV do redis.call('HDEL', P .. ':deleting', ARGV[i]) end
return 0
"""

# KEYS: lease, fence, want. ARGV: holder, ttl_ms. Returns {token, 0}, or {0, ms the holder
# keeps it} after marking the session wanted.
TAKE = """
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
RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1 + redis.call('EXISTS', KEYS[2])
"""

# KEYS: lease, want. ARGV: "holder|token".
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1], KEYS[2]) end
return 0
"""
