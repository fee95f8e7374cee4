"""What ``/fleet`` shows of each backend: its report, this replica's overlay, health, warnings.

Kept apart from the app's wiring: the status page and operators read this shape, and the
fault suite's leak checks read the overlay from it.
"""

from __future__ import annotations

import contextlib
from typing import Any

from proxy.api.kind_check import kind_mismatch
from proxy.config import Config
from proxy.core.fleet import FleetSnapshot
from proxy.state.base import StateStore, StoreUnavailable


def snapshot_json(
    snap: FleetSnapshot | None, now: float, cfg: Config | None = None
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if snap is None:
        return out
    for n in snap.nodes:
        r = n.report
        item: dict[str, Any] = {
            "name": n.name,
            "pool": n.pool,
            "role": n.role,
            "up": n.up,
            "overlay": {
                "reserved_tokens": n.overlay.reserved_tokens,
                "pending_tokens": n.overlay.pending_tokens,
                "inflight": n.overlay.inflight,
                "draining": n.overlay.draining,
                "cooldown_until": n.overlay.cooldown_until or None,
                "ceiling_tokens": n.overlay.ceiling_tokens,
                "pressure": n.overlay.pressure or None,
            },
            "report": None,
        }
        if cfg is not None:
            with contextlib.suppress(KeyError):
                b = cfg.backend(n.name)
                item["kind"] = b.kind
                # Disaggregated serving: prefill, decode or both (``role`` is the pool's).
                item["serving_role"] = b.role
        if r is not None:
            item["report"] = {
                "capacity_tokens": r.capacity_tokens,
                "free_tokens": r.free_tokens,
                "largest_free_block_tokens": r.largest_free_block_tokens,
                "allocator": r.allocator,
                "block_size": r.block_size,
                "running": r.running,
                "waiting": r.waiting,
                "queueing": r.queueing,
                "preemptions": r.preemptions,
                "engines": r.engines,
                "engine_free_tokens": list(r.engine_free_tokens),
                "max_num_seqs": r.max_num_seqs,
                "sleeping": r.sleeping,
                "started_at": r.started_at,
                "reported_at": r.reported_at,
                "age_s": round(now - r.reported_at, 3),
                "uptime_s": round(r.uptime(now), 3),
                "free_fraction": round(r.free_fraction, 4),
                "largest_contiguous_free_block_ratio": round(r.largest_block_ratio, 4),
                "fragmentation_ratio": round(r.fragmentation, 4),
            }
            warning = kind_mismatch(cfg, n.name, r.allocator) if cfg is not None else None
            if warning is not None:
                item["warnings"] = [warning]
        out.append(item)
    return out


def with_health(
    items: list[dict[str, Any]], health: dict[str, dict[str, object]]
) -> list[dict[str, Any]]:
    """Add this replica's verdict on each backend (active checks, ejection) to ``/fleet``."""
    for item in items:
        h = health.get(item["name"])
        item["healthy"] = bool(h["healthy"]) if h is not None else True
        item["ejected"] = bool(h["ejected"]) if h is not None else False
    return items


def with_scrapes(
    items: list[dict[str, Any]], status: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Add the collector's last scrape of each backend to ``/fleet``: why a backend is down.

    ``scrape`` is None on a replica that does not scrape (another holds the collector lock,
    or no collector runs): the store's report is then another replica's work.
    """
    backends = status["backends"] if status is not None else {}
    for item in items:
        b = backends.get(item["name"])
        item["scrape"] = None if b is None else _scrape_json(b)
    return items


def _scrape_json(b: dict[str, Any]) -> dict[str, Any]:
    latency = b["latency_s"]
    return {
        "outcome": b["outcome"],  # ok | down | never
        "reason": b["reason"],  # why it is down, or how far it is from being marked down
        "latency_s": round(latency, 4) if latency is not None else None,
        "last_success_at": b["last_success_at"] or None,
        "consecutive_failures": b["consecutive_failures"],
        # Queueing servers: where the report's ``max_num_seqs`` came from (exported by the
        # server, configured, learned from pinned reports, or unknown) and the evidence
        # being gathered for it (``proxy.core.slot_limit``).
        "max_num_seqs": _slots_json(b),
    }


def _slots_json(b: dict[str, Any]) -> dict[str, Any]:
    learning = b.get("slot_limit") or {}
    return {
        "source": b.get("slots_source", "unknown"),
        "learned": learning.get("limit", 0),
        "learned_at": learning.get("confirmed_at") or None,
        "pinned_running": learning.get("candidate", 0),
        "pinned_reports": learning.get("streak", 0),
    }


def collector_json(status: dict[str, Any] | None) -> dict[str, Any] | None:
    """``/fleet``'s ``collector``: whether this replica scrapes, and its rounds."""
    if status is None:
        return None
    keys = (
        "leader",
        "running",
        "store_ok",
        "rounds_total",
        "rounds_skipped_total",
        "last_round_at",
    )
    return {k: status[k] for k in keys}


async def replicas_json(store: StateStore, names: list[str], now: float) -> dict[str, Any]:
    """``/fleet``'s ``replicas``: the gateway replicas whose leases are live (seconds left)
    and the tokens each reserves per backend (``""``: reservations without a lease)."""
    lease = store.lease
    this = lease.id if lease is not None else None
    try:
        live = await store.live_leases(now)
        states = await store.read(names, now)
    except StoreUnavailable as exc:
        return {"this": this, "error": f"store unavailable: {exc}"}
    reserved: dict[str, dict[str, int]] = {}
    for name, st in states.items():
        for r in st.reservations:
            per = reserved.setdefault(r.replica, {})
            per[name] = per.get(name, 0) + r.tokens
    return {
        "this": this,
        "live": {i: round(until - now, 3) for i, until in sorted(live.items())},
        "reserved_tokens": reserved,
    }
