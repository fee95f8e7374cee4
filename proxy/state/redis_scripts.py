"""The Lua scripts of the Redis store, kept apart from the Python that calls them.

The read-modify-write operations (reserve, set_ceiling, lock take/extend, unlock) are Lua
scripts, so they are atomic across replicas; they mirror the pure rules in base.py
(reservation_fits, pending_tokens, merge_ceiling) number for number, and their number
parsing matches redis_codec's exactly. Times are passed in as arguments and stored exactly
as Python's repr() writes them, never formatted by Lua. The request-path read is one
read-only script returning every backend's three hashes in one reply.

Every script touches the keys of one backend (one hash slot) only, so each runs unchanged on
a single server, Sentinel or Cluster.
"""

from __future__ import annotations

# Shared prelude: number parsing and report validation, the Lua twins of redis_codec's number parsing and report_from_hash.
_LUA_PRELUDE = r"""
local function num(s)
  if type(s) ~= 'string' then return nil end
  local m = s:match('^[-+]?([%d%.]+)$') or s:match('^[-+]?([%d%.]+)[eE][-+]?%d+$')
  if not m then return nil end
  if not (m:match('^%d+%.?%d*$') or m:match('^%.%d+$')) then return nil end
  local n = tonumber(s)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end

local function count(s, min)
  local n = num(s)
  if n == nil or n < 0 then return nil end
  n = math.floor(n)
  if n < min then return nil end
  return n
end

-- Returns largest_free_block_tokens, reported_at, a table {cap, frees} for a report whose
-- reservations count at full demand (queueing, or counts_flights), whether it counts
-- flights on top of the contiguous rule, and the largest demand the server queues rather
-- than refuses (queued_up_to_tokens, 0 when absent); or nil for an invalid report.
local function read_report(key)
  local f = redis.call('HMGET', key, 'capacity_tokens', 'free_tokens',
    'largest_free_block_tokens', 'reported_at', 'allocator', 'block_size',
    'running', 'waiting', 'started_at', 'engine_free', 'flags', 'preemptions', 'engines',
    'max_num_seqs', 'queued_up_to_tokens')
  if count(f[1], 0) == nil or count(f[2], 0) == nil then return nil end
  local largest = count(f[3], 0)
  local reported_at = num(f[4])
  if largest == nil or reported_at == nil or reported_at < 0 then return nil end
  if f[5] and f[5] ~= 'contiguous' and f[5] ~= 'paged' then return nil end
  if f[6] and count(f[6], 1) == nil then return nil end
  if f[7] and count(f[7], 0) == nil then return nil end
  if f[8] and count(f[8], 0) == nil then return nil end
  if f[9] then
    local s = num(f[9])
    if s == nil or s < 0 then return nil end
  end
  if f[12] and count(f[12], 0) == nil then return nil end
  if f[13] and count(f[13], 1) == nil then return nil end
  if f[14] and count(f[14], 0) == nil then return nil end
  if f[15] and count(f[15], 0) == nil then return nil end
  if f[11] and string.find(f[11], '[^qsf]') then return nil end
  local frees = {}
  if f[10] and f[10] ~= '' then
    if string.find(f[10], ',,', 1, true) or string.sub(f[10], 1, 1) == ','
        or string.sub(f[10], -1) == ',' then
      return nil
    end
    for p in string.gmatch(f[10], '[^,]+') do
      local v = count(p, 0)
      if v == nil then return nil end
      frees[#frees + 1] = v
    end
  end
  local lazy = nil
  local queueing = f[11] and string.find(f[11], 'q', 1, true)
  local flights = (not queueing) and f[11] and string.find(f[11], 'f', 1, true) ~= nil
  if queueing or flights then
    if #frees == 0 then frees[1] = count(f[2], 0) end
    lazy = {cap = count(f[1], 0), frees = frees}
  end
  local queued = 0
  if f[15] then queued = count(f[15], 0) end
  return largest, reported_at, lazy, flights, queued
end

-- The lease id of a reservation field "<id>@<lease>" (after its first "@", not at the start),
-- or nil: the twin of proxy.state.lease.split_field. A plain find, not a pattern: it runs
-- on every reservation the reserve walks.
local function lease_of(field)
  local at = string.find(field, '@', 2, true)
  if at == nil or at == #field then return nil end
  return string.sub(field, at + 1)
end

-- The twin of proxy.core.lazy.lazy_headroom: the smallest engine's capacity less
-- max(its used, all reserved), never above the report's largest block.
local function lazy_room(lazy, reserved, largest)
  local per = math.floor(lazy.cap / #lazy.frees)
  local room = nil
  for _, fe in ipairs(lazy.frees) do
    local committed = per - fe
    if reserved > committed then committed = reserved end
    if room == nil or per - committed < room then room = per - committed end
  end
  if largest < room then room = largest end
  if room < 0 then room = 0 end
  return room
end
"""

# KEYS: state, res, gone, leases.  ARGV: id, tokens, now, expires_at, check_fit, headroom,
# grace_s, key_ttl_ms, lease id ('' for none), the time that lease runs to, then (a re-assert
# only) earlier lease ids of this replica: the same reservation's fields under them are
# deleted as this one is written, so a re-assert under a new epoch moves it instead of
# counting it twice until the old id is swept.  A reservation
# whose field names a lease ("<id>@<lease>") counts only while ``leases`` says that lease runs
# past now (proxy.state.lease); a lapsed one is skipped, not deleted: the sweep that finds the
# lapse removes it and counts it (LUA_LEASE_SWEEP).  The walk of ``res`` costs one step per live reservation: forgotten ids live in
# ``gone`` (a sorted set, looked up and pruned by score), so they cost nothing here however
# many pile up (docs/redis-schema.md).
LUA_RESERVE = (
    _LUA_PRELUDE
    + r"""
local id = ARGV[1]
local tokens = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local headroom = tonumber(ARGV[6])
local grace = tonumber(ARGV[7])
local key_ttl = tonumber(ARGV[8])

-- A forgotten id (see forget): this reserve arrived after its release.
local gone = tonumber(redis.call('ZSCORE', KEYS[3], id) or '')
if gone ~= nil and gone > now then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[3])
-- The same, as versions before the gone set wrote it ("~" .. id in res), until those expire.
local tomb = num(string.match(redis.call('HGET', KEYS[2], '~' .. id) or '', '^~ (%S+)$'))
if tomb ~= nil and tomb > now then return 0 end
local largest, reported_at, lazy, flights, queued = read_report(KEYS[1])
local leases = {}
local lf = redis.call('HGETALL', KEYS[4])
for i = 1, #lf, 2 do leases[lf[i]] = num(lf[i + 1]) or 0 end
local pending = 0
local reserved = 0
local dead = {}
local flat = redis.call('HGETALL', KEYS[2])
for i = 1, #flat, 2 do
  local rid, v = flat[i], flat[i + 1]
  if string.sub(rid, 1, 1) == '~' then
    local u = num(string.match(v, '^~ (%S+)$'))
    if u == nil or u <= now then dead[#dead + 1] = rid end
  else
    local t, c, e = string.match(v, '^(%S+) (%S+) (%S+)$')
    t, c, e = count(t, 0), num(c), num(e)
    local owner = lease_of(rid)
    if t == nil or c == nil or e == nil or e <= now then
      dead[#dead + 1] = rid
    elseif owner ~= nil and (leases[owner] or 0) <= now then
      -- its replica's lease lapsed: it counts no more
    elseif rid ~= id then
      reserved = reserved + t
      if largest == nil or c >= reported_at - grace then
        pending = pending + t
      end
    end
  end
end
for i = 1, #dead, 500 do
  redis.call('HDEL', KEYS[2], unpack(dead, i, math.min(i + 499, #dead)))
end
if ARGV[5] == '1' and largest ~= nil then
  local need = tokens * (1.0 + headroom)
  if need <= queued then
    -- the server queues it rather than refusing it (llama.cpp's partitioned slots)
  elseif lazy ~= nil and not flights then
    if need > lazy_room(lazy, reserved, largest) then return 0 end
  elseif pending + need > largest then
    return 0
  elseif flights and need > lazy_room(lazy, reserved, largest) then
    return 0
  end
end
redis.call('HSET', KEYS[2], id, ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4])
if redis.call('PTTL', KEYS[2]) < key_ttl then
  redis.call('PEXPIRE', KEYS[2], key_ttl)
end
local at = string.find(id, '@', 2, true)
if at ~= nil then
  local base = string.sub(id, 1, at)
  for i = 11, #ARGV do
    if ARGV[i] ~= ARGV[9] then redis.call('HDEL', KEYS[2], base .. ARGV[i]) end
  end
end
if ARGV[9] ~= '' then
  if (leases[ARGV[9]] or 0) < tonumber(ARGV[10]) then
    redis.call('HSET', KEYS[4], ARGV[9], ARGV[10])
  end
  if redis.call('PTTL', KEYS[4]) < key_ttl then
    redis.call('PEXPIRE', KEYS[4], key_ttl)
  end
end
return 1
"""
)

# KEYS: res.  ARGV: id, tokens.  Lower a reservation that is still there, keeping its times
# (proxy.state.base.StateStore.shrink); a shrink after the release finds nothing to change.
LUA_SHRINK = (
    _LUA_PRELUDE
    + r"""
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local t, times = string.match(v, '^(%S+) (%S+ %S+)$')
t = count(t, 0)
if t == nil or t <= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. times)
return 1
"""
)

# KEYS: res, gone.  ARGV: id, until, key_ttl_ms.  Release, and score the id ``until`` in the
# gone set so that a reserve of it arriving later is refused
# (proxy.state.base.StateStore.forget); a later ``until`` wins, an earlier one changes nothing.
LUA_FORGET = r"""
redis.call('HDEL', KEYS[1], ARGV[1])
local cur = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or '')
if cur == nil or cur < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
end
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
return 1
"""

# KEYS: flags, state.  ARGV: tokens, now, until.  Mirrors base.merge_ceiling.
LUA_SET_CEILING = (
    _LUA_PRELUDE
    + r"""
local tokens = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local until_new = tonumber(ARGV[3])
local f = redis.call('HMGET', KEYS[1], 'ceiling_tokens', 'ceiling_set_at', 'ceiling_until')
local cur = count(f[1], 0)
local set_at = num(f[2]) or 0
local until_cur = num(f[3]) or 0
if cur ~= nil then
  if now >= until_cur then
    cur = nil
  else
    local largest, reported_at = read_report(KEYS[2])
    if largest ~= nil and reported_at > set_at and largest >= cur then cur = nil end
  end
end
if cur == nil or tokens < cur then
  redis.call('HSET', KEYS[1], 'ceiling_tokens', ARGV[1], 'ceiling_set_at', ARGV[2],
    'ceiling_until', ARGV[3])
  return 1
end
if tokens == cur then
  if now > set_at then redis.call('HSET', KEYS[1], 'ceiling_set_at', ARGV[2]) end
  if until_new > until_cur then redis.call('HSET', KEYS[1], 'ceiling_until', ARGV[3]) end
  return 2
end
return 0
"""
)

# KEYS: the lease set.  ARGV: lease id, now, until, fresh ('1': a new id).  Renew a lease
# still live at now (or register a fresh one) to ``until``, and take every lease that lapsed
# out of the set: returns {1, lapsed ids...}, or {0} when ours had lapsed (or was swept): the
# caller then registers anew. One atomic script, so each lapse is found by one replica only.
LUA_LEASE = r"""
local cur = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '')
if ARGV[4] ~= '1' and (cur == nil or cur <= tonumber(ARGV[2])) then return {0} end
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2]) end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return {1, unpack(gone)}
"""

# KEYS: res, leases.  ARGV: now, lapsed lease ids...  Delete the reservations of lapsed
# leases and their lease entries; returns {live reservations deleted, their tokens}.
LUA_LEASE_SWEEP = (
    _LUA_PRELUDE
    + r"""
local now = tonumber(ARGV[1])
local lapsed = {}
for i = 2, #ARGV do lapsed[ARGV[i]] = true end
local flat = redis.call('HGETALL', KEYS[1])
local dead, n, tokens = {}, 0, 0
for i = 1, #flat, 2 do
  local owner = lease_of(flat[i])
  if owner ~= nil and lapsed[owner] then
    dead[#dead + 1] = flat[i]
    local t, e = string.match(flat[i + 1], '^(%S+) %S+ (%S+)$')
    t, e = count(t, 0), num(e)
    if t ~= nil and e ~= nil and e > now then n, tokens = n + 1, tokens + t end
  end
end
for i = 1, #dead, 500 do
  redis.call('HDEL', KEYS[1], unpack(dead, i, math.min(i + 499, #dead)))
end
for i = 2, #ARGV, 500 do
  redis.call('HDEL', KEYS[2], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
return {n, tokens}
"""
)

# KEYS: lock.  ARGV: owner, ttl_ms.  Take when free (SET NX PX), extend when ours.
LUA_TRY_LOCK = r"""
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if v then return 0 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# KEYS: every key to read.  Returns one flat HGETALL array per key, or the error text for a
# key that is not a hash (a foreign writer's mistake spoils that backend only, not the read).
# One reply for the whole fleet: far less client-side work than a pipeline of 3N replies.
LUA_READ = r"""
local out = {}
for i = 1, #KEYS do
  local r = redis.pcall('HGETALL', KEYS[i])
  if type(r) == 'table' and r.err then out[i] = r.err else out[i] = r end
end
return out
"""

# KEYS: lock.  ARGV: owner.  Compare-and-delete.
LUA_UNLOCK = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
