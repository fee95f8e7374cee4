"""The Redis state store: shared by every gateway replica (and by custom servers that push).

Key schema (documented for outside writers in docs/redis-schema.md), with P = key_prefix and
the braces literal: ``{name}`` is a Redis Cluster hash tag, so one backend's three hashes
live in one slot and every Lua script touches one slot only (the same keys on a single
server, Sentinel or Cluster):

    P:backend:{name}:state   HASH  report fields + status/status_reason, PEXPIRE report TTL
    P:backends               SET   every backend that ever reported
    P:backend:{name}:res     HASH  reservation id -> "tokens created_at expires_at", key TTL refreshed on reserve;
                                   "~<id>" -> "~ <until>": a forgotten id, refused by reserve until then
    P:backend:{name}:flags   HASH  draining, cooldown_until, ceiling_tokens, ceiling_set_at, ceiling_until
    P:retry:{key}            SET   backends a client retry already failed on, with TTL
    P:lock:{name}            STRING owner, PX
    P:events                 LIST  JSON maintenance events, newest first, trimmed

The read-modify-write operations (reserve, set_ceiling, lock take/extend, unlock) are Lua
scripts, so they are atomic across replicas; they mirror the pure rules in base.py
(reservation_fits, pending_tokens, merge_ceiling) number for number. Times are passed in as
arguments and stored exactly as Python's repr() writes them, never formatted by Lua.
The request-path read() is one read-only script returning every backend's three hashes in
one reply (one round trip, one consistent snapshot). On a Cluster it is one script call per
slot, pipelined per node: each backend's hashes are still read together.

Every call runs under a short deadline (StoreConfig.op_timeout_s) with at most one retry
on connection errors and timeouts; anything else from Redis, or the retry failing too,
becomes StoreUnavailable, so the request path never hangs on the store and never sees a
raw redis exception.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import lru_cache
from typing import Any, TypeVar, cast

import orjson
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.config import StoreConfig
from proxy.core.fleet import AllocatorKind, MemoryReport
from proxy.state.base import (
    BackendState,
    Flags,
    Reservation,
    StateStore,
    Status,
    StoreUnavailable,
    check_finite,
    check_reserve_args,
    check_tokens,
    check_ttl,
    live_reservations,
)
from proxy.state.redis_connect import connect

T = TypeVar("T")

DEFAULT_MAX_CONNECTIONS = 64
# The reservations key outlives its newest reservation by this much (clock skew between
# gateways and the Redis server); each reservation still expires on its own expires_at.
RES_KEY_SLACK_MS = 60_000

REPORT_INT_FIELDS = ("capacity_tokens", "free_tokens", "largest_free_block_tokens")
# Optional, written by this version: queue, preemption and data-parallel figures.
REPORT_EXTRA_FIELDS = ("preemptions", "engines", "engine_free", "max_num_seqs", "flags")
REPORT_FIELDS = (
    *REPORT_INT_FIELDS,
    "reported_at",
    "allocator",
    "block_size",
    "running",
    "waiting",
    "started_at",
    *REPORT_EXTRA_FIELDS,
)
ALLOCATORS: tuple[AllocatorKind, ...] = ("contiguous", "paged")

# The one number syntax both Python and Lua read identically (no hex, inf, nan, spaces, "_").
_NUM = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


# --------------------------------------------------------------------------- Lua
# Shared prelude: number parsing and report validation, the Lua twins of _num/report_from_hash.
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

-- Returns largest_free_block_tokens, reported_at and (for a queueing report) a table
-- {cap, frees} of a valid report, or nil.
local function read_report(key)
  local f = redis.call('HMGET', key, 'capacity_tokens', 'free_tokens',
    'largest_free_block_tokens', 'reported_at', 'allocator', 'block_size',
    'running', 'waiting', 'started_at', 'engine_free', 'flags', 'preemptions', 'engines',
    'max_num_seqs')
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
  if f[11] and string.find(f[11], '[^qs]') then return nil end
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
  if f[11] and string.find(f[11], 'q', 1, true) then
    if #frees == 0 then frees[1] = count(f[2], 0) end
    lazy = {cap = count(f[1], 0), frees = frees}
  end
  return largest, reported_at, lazy
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

# KEYS: state, res.  ARGV: id, tokens, now, expires_at, check_fit, headroom, grace_s, key_ttl_ms
_LUA_RESERVE = (
    _LUA_PRELUDE
    + r"""
local id = ARGV[1]
local tokens = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local headroom = tonumber(ARGV[6])
local grace = tonumber(ARGV[7])
local key_ttl = tonumber(ARGV[8])

-- A forgotten id ("~" .. id, see forget): this reserve arrived after its release.
local tomb = num(string.match(redis.call('HGET', KEYS[2], '~' .. id) or '', '^~ (%S+)$'))
if tomb ~= nil and tomb > now then return 0 end
local largest, reported_at, lazy = read_report(KEYS[1])
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
    if t == nil or c == nil or e == nil or e <= now then
      dead[#dead + 1] = rid
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
  if lazy ~= nil then
    if need > lazy_room(lazy, reserved, largest) then return 0 end
  elseif pending + need > largest then
    return 0
  end
end
redis.call('HSET', KEYS[2], id, ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4])
if redis.call('PTTL', KEYS[2]) < key_ttl then
  redis.call('PEXPIRE', KEYS[2], key_ttl)
end
return 1
"""
)

# KEYS: res.  ARGV: id, until, key_ttl_ms.  Release, and leave "~id" = "~ <until>" so that
# a reserve of that id arriving later is refused (proxy.state.base.StateStore.forget).
_LUA_FORGET = r"""
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], '~' .. ARGV[1], '~ ' .. ARGV[2])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 1
"""

# KEYS: flags, state.  ARGV: tokens, now, until.  Mirrors base.merge_ceiling.
_LUA_SET_CEILING = (
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

# KEYS: lock.  ARGV: owner, ttl_ms.  Take when free (SET NX PX), extend when ours.
_LUA_TRY_LOCK = r"""
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
_LUA_READ = r"""
local out = {}
for i = 1, #KEYS do
  local r = redis.pcall('HGETALL', KEYS[i])
  if type(r) == 'table' and r.err then out[i] = r.err else out[i] = r end
end
return out
"""

# KEYS: lock.  ARGV: owner.  Compare-and-delete.
_LUA_UNLOCK = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


# --------------------------------------------------------------------------- parsing
# Parsing is memoised: read() runs every few ms and sees the same strings until the next
# report, while the regex check (needed to match Lua's number syntax exactly) is not free.
@lru_cache(maxsize=16384)
def _num(s: str | None) -> float | None:
    if s is None or _NUM.fullmatch(s) is None:
        return None
    v = float(s)
    return v if math.isfinite(v) else None


def _count(s: str | None, minimum: int = 0) -> int | None:
    v = _num(s)
    if v is None or v < 0:
        return None
    n = math.floor(v)
    return n if n >= minimum else None


def _redis_float(x: float) -> str:
    """A float as Redis stores it: repr round-trips exactly, and Lua's tonumber reads it."""
    return repr(float(x))


def report_from_hash(h: dict[str, str]) -> tuple[MemoryReport | None, str]:
    """A state hash's report, or None with a reason when fields are missing or malformed.

    Required: capacity_tokens, free_tokens, largest_free_block_tokens, reported_at. Optional:
    allocator (contiguous|paged), block_size (>= 1), running, waiting, started_at. Numbers are
    plain decimals (``30000``, ``1712345678.25``); token counts are rounded down.
    """
    return _report_from_fields(tuple(h.get(k) for k in REPORT_FIELDS))


@lru_cache(maxsize=1024)
def _report_from_fields(values: tuple[str | None, ...]) -> tuple[MemoryReport | None, str]:
    if all(v is None for v in values):
        return None, ""
    h = {k: v for k, v in zip(REPORT_FIELDS, values, strict=True) if v is not None}
    ints: dict[str, int] = {}
    for key in REPORT_INT_FIELDS:
        v = _count(h.get(key))
        if v is None:
            return None, f"bad report: {key}={h.get(key)!r}"
        ints[key] = v
    reported_at = _num(h.get("reported_at"))
    if reported_at is None or reported_at < 0:
        return None, f"bad report: reported_at={h.get('reported_at')!r}"
    allocator = h.get("allocator", "contiguous")
    if allocator not in ALLOCATORS:
        return None, f"bad report: allocator={allocator!r}"
    extra: dict[str, int] = {}
    for key, minimum, default in (("block_size", 1, 1), ("running", 0, 0), ("waiting", 0, 0)):
        if key in h:
            v = _count(h[key], minimum)
            if v is None:
                return None, f"bad report: {key}={h[key]!r}"
            extra[key] = v
        else:
            extra[key] = default
    started_at = 0.0
    if "started_at" in h:
        s = _num(h["started_at"])
        if s is None or s < 0:
            return None, f"bad report: started_at={h['started_at']!r}"
        started_at = s
    more = _parse_extra(h)
    if isinstance(more, str):
        return None, more
    report = MemoryReport(
        capacity_tokens=ints["capacity_tokens"],
        free_tokens=ints["free_tokens"],
        largest_free_block_tokens=ints["largest_free_block_tokens"],
        allocator=allocator,
        block_size=extra["block_size"],
        running=extra["running"],
        waiting=extra["waiting"],
        started_at=started_at,
        reported_at=reported_at,
        **more,
    )
    return report, ""


def _parse_extra(h: dict[str, str]) -> dict[str, Any] | str:
    """The optional fields of ``REPORT_EXTRA_FIELDS`` as MemoryReport keywords, or a reason."""
    out: dict[str, Any] = {}
    for key, minimum in (("preemptions", 0), ("engines", 1), ("max_num_seqs", 0)):
        if key in h:
            v = _count(h[key], minimum)
            if v is None:
                return f"bad report: {key}={h[key]!r}"
            out[key] = v
    if h.get("engine_free"):
        parts = [_count(p) for p in h["engine_free"].split(",")]
        if any(p is None for p in parts):
            return f"bad report: engine_free={h['engine_free']!r}"
        out["engine_free_tokens"] = tuple(p for p in parts if p is not None)
    flags = h.get("flags", "")
    if flags.strip("qs"):
        return f"bad report: flags={flags!r}"
    out["queueing"] = "q" in flags
    out["sleeping"] = "s" in flags
    return out


def report_fields(report: MemoryReport) -> dict[str, str]:
    """The state hash fields for a report (what a custom server writes too)."""
    return {
        "capacity_tokens": str(int(report.capacity_tokens)),
        "free_tokens": str(int(report.free_tokens)),
        "largest_free_block_tokens": str(int(report.largest_free_block_tokens)),
        "allocator": report.allocator,
        "block_size": str(int(report.block_size)),
        "running": str(int(report.running)),
        "waiting": str(int(report.waiting)),
        "started_at": _redis_float(report.started_at),
        "reported_at": _redis_float(report.reported_at),
        "preemptions": str(int(report.preemptions)),
        "engines": str(int(report.engines)),
        "engine_free": ",".join(str(int(f)) for f in report.engine_free_tokens),
        "max_num_seqs": str(int(report.max_num_seqs)),
        # One letter per true flag: q = queueing, s = sleeping.
        "flags": ("q" if report.queueing else "") + ("s" if report.sleeping else ""),
    }


@lru_cache(maxsize=16384)
def _res_value(value: str) -> tuple[int, float, float] | None:
    """``"<tokens> <created_at> <expires_at>"`` or None when malformed."""
    parts = value.split(" ")
    if len(parts) != 3:
        return None
    tokens, created, expires = _count(parts[0]), _num(parts[1]), _num(parts[2])
    if tokens is None or created is None or expires is None:
        return None
    return tokens, created, expires


def _parse_reservations(h: dict[str, str]) -> list[Reservation]:
    out: list[Reservation] = []
    for rid, value in h.items():
        parsed = _res_value(value)
        if parsed is not None:
            out.append(Reservation(rid, *parsed))
    return out


def _parse_flags(h: dict[str, str]) -> Flags:
    return Flags(
        draining=h.get("draining", "0").lower() in ("1", "true", "yes"),
        cooldown_until=_num(h.get("cooldown_until")) or 0.0,
        ceiling_tokens=_count(h.get("ceiling_tokens")),
        ceiling_set_at=_num(h.get("ceiling_set_at")) or 0.0,
        ceiling_until=_num(h.get("ceiling_until")) or 0.0,
    )


def _parse_state(
    name: str, state: dict[str, str], res: dict[str, str], flags: dict[str, str], now: float
) -> BackendState:
    report, bad = report_from_hash(state)
    raw_status = state.get("status")
    status: Status
    if raw_status in ("up", "down", "unknown"):
        status = cast(Status, raw_status)
    else:
        status = "up" if report is not None else "unknown"
    reason = state.get("status_reason", "")
    if bad:
        reason = f"{reason}; {bad}" if reason else bad
    return BackendState(
        name=name,
        status=status,
        status_reason=reason,
        report=report,
        reservations=live_reservations(_parse_reservations(res), now),
        flags=_parse_flags(flags),
    )


def _ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000.0))


def _glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


# --------------------------------------------------------------------------- store
class RedisStore(StateStore):
    """The shared store. Creating it does no I/O; connections are made on first use."""

    def __init__(self, cfg: StoreConfig, *, max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        self._timeout = cfg.op_timeout_s
        self._prefix = cfg.key_prefix
        self._conn = connect(cfg, max_connections)
        self._r = self._conn.client
        # A Cluster refuses MULTI across slots: there the backends-set update is pipelined
        # beside the (single-slot) report write instead of inside one transaction.
        self._cluster = self._conn.cluster
        self._reserve = self._r.register_script(_LUA_RESERVE)
        self._set_ceiling = self._r.register_script(_LUA_SET_CEILING)
        self._try_lock = self._r.register_script(_LUA_TRY_LOCK)
        self._unlock = self._r.register_script(_LUA_UNLOCK)
        self._read = self._r.register_script(_LUA_READ)
        self._forget = self._r.register_script(_LUA_FORGET)

    # --- keys ---
    def _k_state(self, name: str) -> str:
        return f"{self._prefix}:backend:{{{name}}}:state"

    def _k_res(self, name: str) -> str:
        return f"{self._prefix}:backend:{{{name}}}:res"

    def _k_flags(self, name: str) -> str:
        return f"{self._prefix}:backend:{{{name}}}:flags"

    @property
    def _k_backends(self) -> str:
        return f"{self._prefix}:backends"

    @property
    def _k_events(self) -> str:
        return f"{self._prefix}:events"

    # --- the deadline ---
    async def _call(self, what: str, op: Callable[[], Awaitable[T]]) -> T:
        """Run one store operation under the deadline, retrying once on a transient failure."""
        last: BaseException | None = None
        for _attempt in range(2):
            try:
                async with asyncio.timeout(self._timeout):
                    return await op()
            except (TimeoutError, RedisTimeoutError, RedisConnectionError, OSError) as exc:
                last = exc
            except RedisError as exc:
                raise StoreUnavailable(f"redis {what}: {exc}") from exc
        raise StoreUnavailable(
            f"redis {what}: no answer within {self._timeout}s after one retry ({type(last).__name__}: {last})"
        ) from last

    async def _smembers(self, key: str) -> set[str]:
        return cast(set[str], await self._r.smembers(key))  # decode_responses: always str

    # --- reports ---
    async def put_report(self, name: str, report: MemoryReport, ttl_s: float) -> None:
        check_ttl(ttl_s)
        fields = {**report_fields(report), "status": "up", "status_reason": ""}

        async def op() -> None:
            async with self._r.pipeline(transaction=not self._cluster) as pipe:
                pipe.hset(self._k_state(name), mapping=fields)
                pipe.pexpire(self._k_state(name), _ms(ttl_s))
                pipe.sadd(self._k_backends, name)
                await pipe.execute()

        await self._call("put_report", op)

    async def mark_down(self, name: str, reason: str, ttl_s: float) -> None:
        check_ttl(ttl_s)

        async def op() -> None:
            async with self._r.pipeline(transaction=not self._cluster) as pipe:
                pipe.hset(self._k_state(name), mapping={"status": "down", "status_reason": reason})
                pipe.pexpire(self._k_state(name), _ms(ttl_s))
                pipe.sadd(self._k_backends, name)
                await pipe.execute()

        await self._call("mark_down", op)

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        """One script call for every backend: one round trip, one consistent snapshot."""
        unique = list(dict.fromkeys(names))
        if not unique:
            return {}
        keys = [k for n in unique for k in (self._k_state(n), self._k_res(n), self._k_flags(n))]
        if self._cluster:
            unique, results = await self._read_per_slot(unique)
        else:
            results = await self._call("read", lambda: self._read(keys=keys))
        out: dict[str, BackendState] = {}
        for i, n in enumerate(unique):
            parts: list[dict[str, str]] = []
            errors: list[str] = []
            for label, value in zip(
                ("state", "res", "flags"), results[3 * i : 3 * i + 3], strict=True
            ):
                if isinstance(value, list):
                    it = iter(value)
                    parts.append(dict(zip(it, it, strict=True)))
                else:  # the error text for a key of the wrong type
                    errors.append(f"{label} key unreadable: {value}")
                    parts.append({})
            st = _parse_state(n, parts[0], parts[1], parts[2], now)
            if errors:
                extra = "; ".join(errors)
                reason = f"{st.status_reason}; {extra}" if st.status_reason else extra
                st = replace(st, status_reason=reason)
            out[n] = st
        return out

    async def _read_per_slot(self, names: list[str]) -> tuple[list[str], list[Any]]:
        """Cluster: one read script per hash slot, pipelined (one batch per node).

        Returns the names in reply order with the flat per-key replies, like the single call.
        """
        by_slot: dict[int, list[str]] = {}
        for n in names:
            by_slot.setdefault(key_slot(self._k_state(n).encode()), []).append(n)
        groups = list(by_slot.values())

        async def op() -> list[Any]:
            async with self._r.pipeline() as pipe:
                for group in groups:
                    keys = [
                        k
                        for n in group
                        for k in (self._k_state(n), self._k_res(n), self._k_flags(n))
                    ]
                    pipe.eval(_LUA_READ, len(keys), *keys)
                return cast(list[Any], await pipe.execute())

        replies = await self._call("read", op)
        return [n for g in groups for n in g], [r for reply in replies for r in reply]

    async def _scan(self, pattern: str) -> list[str]:
        """Every key matching ``pattern``; each SCAN page under its own deadline, every primary."""
        found: list[str] = []
        nodes: list[Any] = self._r.get_primaries() if self._cluster else [None]
        for node in nodes:
            target = {} if node is None else {"target_nodes": node}
            cursor: int = 0
            while True:
                reply = await self._call(
                    "known_backends",
                    lambda c=cursor, t=target: self._r.scan(c, match=pattern, count=1000, **t),  # type: ignore[misc]
                )
                if self._cluster:
                    # redis-py answers a cluster SCAN as ({node name: cursor}, keys).
                    cursors, keys = reply
                    cursor = int(next(iter(cursors.values()), 0))
                else:
                    cursor, keys = reply
                found.extend(cast(list[str], keys))
                if int(cursor) == 0:
                    break
        return found

    async def known_backends(self) -> set[str]:
        members = await self._call("known_backends", lambda: self._smembers(self._k_backends))
        names = set(members)
        # Custom servers that push a state hash but forget the SADD are found by their key.
        head, tail = f"{self._prefix}:backend:{{", "}:state"
        pattern = f"{_glob_escape(head)}*{_glob_escape(tail)}"
        for key in await self._scan(pattern):
            if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
                names.add(key[len(head) : -len(tail)])
        return names

    # --- reservations ---
    async def reserve(
        self,
        name: str,
        reservation_id: str,
        tokens: int,
        now: float,
        ttl_s: float,
        *,
        check_fit: bool = True,
        headroom: float = 0.0,
        grace_s: float = 0.0,
    ) -> bool:
        check_reserve_args(tokens, now, ttl_s, headroom, grace_s)
        keys = [self._k_state(name), self._k_res(name)]
        args = [
            reservation_id,
            str(tokens),
            _redis_float(now),
            _redis_float(now + ttl_s),
            "1" if check_fit else "0",
            _redis_float(headroom),
            _redis_float(grace_s),
            str(_ms(ttl_s) + RES_KEY_SLACK_MS),
        ]
        result = await self._call("reserve", lambda: self._reserve(keys=keys, args=args))
        return int(result) == 1

    async def release(self, name: str, reservation_id: str) -> None:
        await self._call("release", lambda: self._r.hdel(self._k_res(name), reservation_id))

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        check_finite(until=until)
        keys = [self._k_res(name)]
        # The key must outlive the tombstone (its until is on the store's clock, as the TTL is).
        ttl_ms = _ms(max(0.0, until - self.now())) + RES_KEY_SLACK_MS
        args = [reservation_id, _redis_float(until), str(ttl_ms)]
        await self._call("forget", lambda: self._forget(keys=keys, args=args))

    async def reservations(self, name: str, now: float) -> list[Reservation]:
        h = await self._call("reservations", lambda: self._r.hgetall(self._k_res(name)))
        return list(live_reservations(_parse_reservations(cast(dict[str, str], h)), now))

    # --- flags ---
    async def set_draining(self, name: str, draining: bool) -> None:
        value = "1" if draining else "0"
        await self._call(
            "set_draining", lambda: self._r.hset(self._k_flags(name), "draining", value)
        )

    async def set_cooldown(self, name: str, until: float) -> None:
        check_finite(until=until)
        value = _redis_float(until)
        await self._call(
            "set_cooldown", lambda: self._r.hset(self._k_flags(name), "cooldown_until", value)
        )

    async def set_ceiling(self, name: str, tokens: int, now: float, until: float) -> None:
        check_tokens(tokens)
        check_finite(now=now, until=until)
        keys = [self._k_flags(name), self._k_state(name)]
        args = [str(tokens), _redis_float(now), _redis_float(until)]
        await self._call("set_ceiling", lambda: self._set_ceiling(keys=keys, args=args))

    # --- retry memory ---
    def _k_retry(self, retry_key: str) -> str:
        return f"{self._prefix}:retry:{retry_key}"

    async def add_failed(self, retry_key: str, name: str, ttl_s: float) -> None:
        check_ttl(ttl_s)

        async def op() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.sadd(self._k_retry(retry_key), name)
                pipe.pexpire(self._k_retry(retry_key), _ms(ttl_s))
                await pipe.execute()

        await self._call("add_failed", op)

    async def failed_on(self, retry_key: str) -> set[str]:
        return await self._call("failed_on", lambda: self._smembers(self._k_retry(retry_key)))

    # --- coordination ---
    def _k_lock(self, lock: str) -> str:
        return f"{self._prefix}:lock:{lock}"

    async def try_lock(self, lock: str, owner: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        keys, args = [self._k_lock(lock)], [owner, str(_ms(ttl_s))]
        result = await self._call("try_lock", lambda: self._try_lock(keys=keys, args=args))
        return int(result) == 1

    async def unlock(self, lock: str, owner: str) -> None:
        keys, args = [self._k_lock(lock)], [owner]
        await self._call("unlock", lambda: self._unlock(keys=keys, args=args))

    # --- events ---
    async def append_event(self, event: dict[str, Any], max_len: int = 1000) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        raw = orjson.dumps(event).decode()

        async def op() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.lpush(self._k_events, raw)
                pipe.ltrim(self._k_events, 0, max_len - 1)
                await pipe.execute()

        await self._call("append_event", op)

    async def events(self, limit: int = 100) -> list[dict[str, Any]]:
        if limit < 1:
            return []
        items = await self._call("events", lambda: self._r.lrange(self._k_events, 0, limit - 1))
        out: list[dict[str, Any]] = []
        for raw in items:
            try:
                item = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a foreign writer's junk does not break the log
            if isinstance(item, dict):
                out.append(item)
        return out

    # --- the shared clock ---
    async def server_time(self) -> float:
        """Redis ``TIME`` as unix seconds: the one clock every replica compares shared times on."""
        sec, usec = await self._call("time", lambda: self._r.time())
        return float(sec) + float(usec) / 1e6

    async def sync_clock(self, samples: int = 3) -> float:
        """Measure ``clock_offset`` (Redis clock minus ours), keeping the lowest-RTT sample.

        The server read its clock somewhere inside the round trip; assuming the middle, the
        error is at most half the RTT, so the quickest of a few samples is the most exact.
        """
        best: tuple[float, float] | None = None
        for _ in range(samples):
            t0 = time.time()
            server = await self.server_time()
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, server - (t0 + t1) / 2.0)
        assert best is not None
        self.clock_offset = best[1]
        return self.clock_offset

    # --- lifecycle ---
    async def ping(self) -> bool:
        try:
            return bool(await self._call("ping", lambda: self._r.ping()))
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._conn.close()
