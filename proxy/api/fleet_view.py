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
