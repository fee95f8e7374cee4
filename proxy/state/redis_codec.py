"""Key names and value encoding of the Redis store: what outside writers must match.

Key schema (documented for outside writers in docs/redis-schema.md), with P = key_prefix and
the braces literal: ``{name}`` is a Redis Cluster hash tag, so one backend's keys
live in one slot and every Lua script touches one slot only (the same keys on a single
server, Sentinel or Cluster):

    P:backend:{name}:state   HASH  report fields + status/status_reason, PEXPIRE report TTL
    P:backends               SET   every backend that ever reported
    P:backend:{name}:res     HASH  reservation id -> "tokens created_at expires_at", key TTL refreshed on reserve
                                   (older versions also wrote "~<id>" -> "~ <until>" here: still honoured)
    P:backend:{name}:gone    ZSET  forgotten reservation id, score = until: refused by reserve until then
    P:backend:{name}:flags   HASH  draining, cooldown_until, ceiling_tokens, ceiling_set_at, ceiling_until
    P:backend:{name}:leases  HASH  replica lease id -> the time it runs to (a reservation field
                                   "<id>@<lease id>" counts only while its lease runs)
    P:leases                 ZSET  every replica's lease id, scored by the time it runs to
    P:retry:{key}            SET   backends a client retry already failed on, with TTL
    P:lock:{name}            STRING owner, PX
    P:events                 LIST  JSON maintenance events, newest first, trimmed

Reports, reservations and flags are parsed here exactly as the Lua scripts in
redis_scripts.py parse them (one number syntax for both), so a value the scripts accept is
one read() accepts and the other way round. Kept apart from the store class so the wire
format can be read (and tested) without any connection code.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from functools import lru_cache
from typing import Any, cast

from proxy.core.fleet import AllocatorKind, MemoryReport
from proxy.state.base import BackendState, Flags, Reservation, Status, live_reservations
from proxy.state.lease import counting, split_field

# The reservations key outlives its newest reservation by this much (clock skew between
# gateways and the Redis server); each reservation still expires on its own expires_at.
RES_KEY_SLACK_MS = 60_000

REPORT_INT_FIELDS = ("capacity_tokens", "free_tokens", "largest_free_block_tokens")
# Optional, written by this version: queue, preemption and data-parallel figures.
REPORT_EXTRA_FIELDS = (
    "preemptions",
    "engines",
    "engine_free",
    "max_num_seqs",
    "flags",
    "prefill",
    "queued_up_to_tokens",
)
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


class RedisKeys:
    """The key names of one deployment (``prefix`` = StoreConfig.key_prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.backends = f"{prefix}:backends"
        self.events = f"{prefix}:events"
        self.leases_set = f"{prefix}:leases"
        # A backend's state key is ``state_head + name + state_tail`` (found by SCAN too).
        self.state_head = f"{prefix}:backend:{{"
        self.state_tail = "}:state"

    def state(self, name: str) -> str:
        return f"{self.prefix}:backend:{{{name}}}:state"

    def res(self, name: str) -> str:
        return f"{self.prefix}:backend:{{{name}}}:res"

    def gone(self, name: str) -> str:
        return f"{self.prefix}:backend:{{{name}}}:gone"

    def flags(self, name: str) -> str:
        return f"{self.prefix}:backend:{{{name}}}:flags"

    def leases(self, name: str) -> str:
        return f"{self.prefix}:backend:{{{name}}}:leases"

    def retry(self, retry_key: str) -> str:
        return f"{self.prefix}:retry:{retry_key}"

    def lock(self, lock: str) -> str:
        return f"{self.prefix}:lock:{lock}"

    def backend_hashes(self, name: str) -> tuple[str, str, str, str]:
        """The four keys read() fetches for a backend, in reply order."""
        return self.state(name), self.res(name), self.flags(name), self.leases(name)


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


def redis_float(x: float) -> str:
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
    for key, minimum in (
        ("preemptions", 0),
        ("engines", 1),
        ("max_num_seqs", 0),
        ("queued_up_to_tokens", 0),
    ):
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
    if flags.strip("qsf"):
        return f"bad report: flags={flags!r}"
    out["queueing"] = "q" in flags
    out["sleeping"] = "s" in flags
    out["counts_flights"] = "f" in flags
    if h.get("prefill"):
        # "tokens,seconds": the cumulative prefill counters (absent from older writers).
        counters = [_num(p) for p in h["prefill"].split(",")]
        if len(counters) != 2 or any(c is None or c < 0 for c in counters):
            return f"bad report: prefill={h['prefill']!r}"
        out["prefill_tokens"], out["prefill_seconds"] = counters
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
        "started_at": redis_float(report.started_at),
        "reported_at": redis_float(report.reported_at),
        "preemptions": str(int(report.preemptions)),
        "engines": str(int(report.engines)),
        "engine_free": ",".join(str(int(f)) for f in report.engine_free_tokens),
        "max_num_seqs": str(int(report.max_num_seqs)),
        # One letter per true flag: q = queueing, s = sleeping, f = counts_flights.
        "flags": ("q" if report.queueing else "")
        + ("s" if report.sleeping else "")
        + ("f" if report.counts_flights else ""),
        "prefill": f"{redis_float(report.prefill_tokens)},{redis_float(report.prefill_seconds)}",
        "queued_up_to_tokens": str(int(report.queued_up_to_tokens)),
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


def parse_reservations(h: dict[str, str]) -> list[Reservation]:
    """Every well-formed reservation, with its lease id split off its field."""
    out: list[Reservation] = []
    for field, value in h.items():
        parsed = _res_value(value)
        if parsed is not None:
            rid, lease = split_field(field)
            out.append(Reservation(rid, *parsed, lease))
    return out


def parse_leases(h: dict[str, str]) -> dict[str, float]:
    """A backend's ``:leases`` hash: lease id -> the time it runs to (malformed: lapsed)."""
    return {lease: _num(v) or 0.0 for lease, v in h.items()}


def counting_reservations(
    res: dict[str, str], leases: dict[str, str], now: float
) -> list[Reservation]:
    """The reservations of a ``:res`` hash that count at ``now`` (live, and their lease too)."""
    return counting(parse_reservations(res), parse_leases(leases), now)


def _parse_flags(h: dict[str, str]) -> Flags:
    return Flags(
        draining=h.get("draining", "0").lower() in ("1", "true", "yes"),
        cooldown_until=_num(h.get("cooldown_until")) or 0.0,
        ceiling_tokens=_count(h.get("ceiling_tokens")),
        ceiling_set_at=_num(h.get("ceiling_set_at")) or 0.0,
        ceiling_until=_num(h.get("ceiling_until")) or 0.0,
    )


def parse_state(
    name: str,
    state: dict[str, str],
    res: dict[str, str],
    flags: dict[str, str],
    now: float,
    leases: dict[str, str] | None = None,
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
        reservations=live_reservations(counting_reservations(res, leases or {}, now), now),
        flags=_parse_flags(flags),
    )


def ttl_ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000.0))


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", s)


def states_from_replies(
    names: list[str], results: list[Any], now: float
) -> dict[str, BackendState]:
    """Each backend's state from the read script's reply: four flat HGETALLs per name.

    A key of the wrong type comes back as its error text: that backend gets the error in its
    status_reason, the others are unaffected.
    """
    out: dict[str, BackendState] = {}
    for i, n in enumerate(names):
        parts: list[dict[str, str]] = []
        errors: list[str] = []
        labels = ("state", "res", "flags", "leases")
        for label, value in zip(labels, results[4 * i : 4 * i + 4], strict=True):
            if isinstance(value, list):
                it = iter(value)
                parts.append(dict(zip(it, it, strict=True)))
            else:  # the error text for a key of the wrong type
                errors.append(f"{label} key unreadable: {value}")
                parts.append({})
        st = parse_state(n, parts[0], parts[1], parts[2], now, parts[3])
        if errors:
            extra = "; ".join(errors)
            reason = f"{st.status_reason}; {extra}" if st.status_reason else extra
            st = replace(st, status_reason=reason)
        out[n] = st
    return out
