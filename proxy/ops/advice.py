"""Scaling advice: ``none``, ``restart`` (which nodes) or ``scale_up``, with reasons and numbers.

Pure: a fleet snapshot, recent allocation failures, fragmentation trends and the time go in.
The same answer drives ``GET /fleet/advice``, the ``kvroute_scaling_advice`` gauge and the
maintenance loop (which restarts exactly the nodes advised as ready), so what the operator
reads is what the gateway does.

The distinction the problem statement asks for: an allocation failure is a capacity problem
only when no node had that much free memory at all. When some node had it, just not in one
block, adding replicas is the wrong fix: restarting that node is the right one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from proxy.config import MaintenanceConfig
from proxy.core.fleet import FleetSnapshot
from proxy.core.freshness import judged_at
from proxy.ops.diagnosis import Failure, Trend
from proxy.ops.node_advice import NodeAdvice, assess, can_take_out, healthy

Action = Literal["none", "restart", "scale_up"]
ACTIONS: tuple[Action, ...] = ("none", "restart", "scale_up")


@dataclass(frozen=True, slots=True)
class Advice:
    action: Action
    at: float
    reasons: tuple[str, ...]
    restart: tuple[str, ...]  # nodes to restart now, in order (ready ones only)
    nodes: tuple[NodeAdvice, ...]
    failures: Mapping[str, float]
    fleet: Mapping[str, float]
    watch: tuple[str, ...] = ()  # fragmenting, not yet worth a restart
    extra: Mapping[str, Any] = field(default_factory=dict)

    def node(self, name: str) -> NodeAdvice | None:
        return next((n for n in self.nodes if n.name == name), None)

    def to_json(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            d = asdict(n)
            d["restart_reasons"] = list(n.restart_reasons)
            d["candidate"] = n.candidate
            nodes.append(d)
        return {
            "action": self.action,
            "at": self.at,
            "restart": list(self.restart),
            "watch": list(self.watch),
            "reasons": list(self.reasons),
            "failures": dict(self.failures),
            "fleet": dict(self.fleet),
            "nodes": nodes,
        }


def effective_demand_tokens(snapshot: FleetSnapshot, capacity_failures: Iterable[Failure]) -> int:
    """KV demand without fragmentation failures: memory in use, plus demand no node could hold.

    In use: capacity - free on each node up and reporting, plus reservations not yet in its
    report. Unmet: the demand of capacity failures (no node had that much free memory at all).
    Fragmentation failures are left out: that memory exists, it is only broken up.
    """
    used = 0
    for n in snapshot.nodes:
        if n.up and n.report is not None:
            used += (
                max(0, n.report.capacity_tokens - n.report.free_tokens) + n.overlay.pending_tokens
            )
    return used + sum(f.demand for f in capacity_failures if not f.fixable_by_restart)


def advise(
    snapshot: FleetSnapshot,
    now: float,
    cfg: MaintenanceConfig,
    *,
    stale_after_s: float,
    failures: Iterable[Failure] = (),
    rate_failures: Iterable[Failure] | None = None,
    trends: Mapping[str, Trend] | None = None,
    below_since: Mapping[str, float] | None = None,
    busy: Iterable[str] = (),
    blocked_until: Mapping[str, float] | None = None,
) -> Advice:
    """What to do now. ``failures``: those of the last ``failure_window_s``; ``rate_failures``:
    those of the last minute, for the effective demand (defaults to ``failures``);
    ``busy``: nodes being restarted now (they count as out of the fleet); ``blocked_until``:
    no restart of a node before this time (its last attempt, from the shared event log)."""
    fails = list(failures)
    trends = trends or {}
    below_since = below_since or {}
    blocked_until = blocked_until or {}
    busy_set = set(busy)
    fixable = [f for f in fails if f.fixable_by_restart]
    capacity = [f for f in fails if not f.fixable_by_restart]
    failed_here: dict[str, int] = {}
    for f in fixable:
        for name in f.room_on:
            failed_here[name] = max(failed_here.get(name, 0), f.demand)

    # Staleness judged as routing judges it (proxy.core.freshness): against the newest report.
    judged = judged_at(snapshot, now, stale_after_s)
    assessed = [
        assess(
            n,
            now,
            cfg,
            stale_after_s,
            trends.get(n.name),
            below_since.get(n.name),
            failed_here.get(n.name, 0),
            blocked_until.get(n.name),
            judged,
        )
        for n in snapshot.nodes
    ]
    # Most fragmented first; each one ready only if the fleet can spare it on top of those before.
    ordered = sorted(
        (a for a in assessed if a.candidate and a.name not in busy_set),
        key=lambda a: (a.largest_contiguous_free_block_ratio or 0.0, a.name),
    )
    taken = set(busy_set)
    ready: list[str] = []
    updated: dict[str, NodeAdvice] = {}
    for a in ordered:
        ok, why = can_take_out(snapshot, a.name, now, cfg, stale_after_s, taken)
        if ok and len(taken) < cfg.max_concurrent_restarts:
            taken.add(a.name)
            ready.append(a.name)
        elif ok:
            why = f"waiting: {len(taken)} node(s) restarting or going first (max_concurrent_restarts {cfg.max_concurrent_restarts})"
            ok = False
        updated[a.name] = NodeAdvice(**{**asdict(a), "ready": ok, "why": why})
    nodes = tuple(updated.get(a.name, a) for a in assessed)
    candidates = ordered
    watch = tuple(
        a.name
        for a in nodes
        if not a.candidate
        and a.state == "up"
        and (
            a.level in ("high", "severe")
            or (trends.get(a.name) is not None and trends[a.name].rising)
        )
    )

    reported = [n for n in snapshot.nodes if n.up and n.report is not None]
    cap_total = sum(n.report.capacity_tokens for n in reported if n.report is not None)
    free_total = sum(n.report.free_tokens for n in reported if n.report is not None)
    largest = max(
        (n.report.largest_free_block_tokens for n in reported if n.report is not None), default=0
    )
    largest_node_free = max(
        (n.usable_free() for n in reported if n.report is not None),
        default=0,
    )
    # A capacity failure still stands while no node has that much free memory; once one has
    # (requests finished), it was a peak, and adding replicas for it would be premature.
    current = [f for f in capacity if f.demand > largest_node_free]
    transient = len(capacity) - len(current)
    # Likewise a fragmentation failure stands while a node it names still has the memory for
    # it and no block (not once that node restarted, or filled up).
    by_name = snapshot.by_name()

    def still_fragmented(f: Failure) -> bool:
        for name in f.room_on:
            n = by_name.get(name)
            r = n.report if n is not None else None
            # In whole blocks, as NodeView.fits decides: a block a few tokens short is short.
            if (
                r is not None
                and r.largest_free_block_tokens < r.whole_blocks(f.demand) <= r.free_tokens
            ):
                return True
        return False

    current_fixable = [f for f in fixable if still_fragmented(f)]
    demand = effective_demand_tokens(snapshot, fails if rate_failures is None else rate_failures)
    window = cfg.failure_window_s
    max_cap_demand = max((f.demand for f in capacity), default=0)
    max_frag_demand = max((f.demand for f in fixable), default=0)
    failures_out: dict[str, float] = {
        "window_s": window,
        "total": len(fails),
        "fragmentation": len(fixable),
        "capacity": len(capacity),
        "capacity_still_short": len(current),
        "fragmentation_still_fragmented": len(current_fixable),
        "at_high_free_memory": sum(1 for f in fails if f.at_high_free),
        "max_fragmentation_demand_tokens": max_frag_demand,
        "max_capacity_demand_tokens": max_cap_demand,
    }
    fleet_out: dict[str, float] = {
        "nodes": len(snapshot.nodes),
        "healthy_nodes": sum(1 for n in snapshot.nodes if healthy(n, now, stale_after_s, judged)),
        "capacity_tokens": cap_total,
        "free_tokens": free_total,
        "free_fraction": round(free_total / cap_total, 4) if cap_total else 0.0,
        "largest_free_block_tokens": largest,
        "largest_node_free_tokens": largest_node_free,
        "effective_demand_tokens": demand,
        "effective_utilisation": round(demand / cap_total, 4) if cap_total else 0.0,
    }

    reasons: list[str] = []
    action: Action
    if current and len(current) >= len(current_fixable):
        action = "scale_up"
        reasons.append(
            f"{len(current)} allocation failure(s) in the last {window:.0f}s were capacity: demand up to "
            f"{max_cap_demand} tokens exceeds the total free memory of every node "
            f"(most free on one node now: {largest_node_free}; fleet free {free_total} of {cap_total})"
        )
        if fixable:
            reasons.append(
                f"{len(fixable)} other failure(s) were fragmentation: restart those nodes as well"
            )
        reasons.append(
            f"effective demand {demand} tokens of {cap_total} ({fleet_out['effective_utilisation']:.0%})"
        )
    elif candidates:
        action = "restart"
        for a in candidates:
            a2 = updated[a.name]
            what = ", ".join(a.restart_reasons)
            reasons.append(
                f"{a.name} ({what}): largest free block {a.largest_free_block_tokens} of "
                f"{a.free_tokens} free tokens (ratio {a.largest_contiguous_free_block_ratio:.2f}, "
                f"{(a.free_fraction or 0):.0%} free), uptime {a.uptime_s if a.uptime_s is not None else '?'}s; "
                + ("ready: " if a2.ready else "not yet: ")
                + a2.why
            )
        if fixable:
            reasons.append(
                f"{len(fixable)} allocation failure(s) in the last {window:.0f}s were fragmentation: a node "
                f"had enough free memory in total but no block of up to {max_frag_demand} tokens; "
                "a restart restores it, more replicas would not be needed"
            )
        else:
            reasons.append("no capacity failures: do not scale up")
    else:
        action = "none"
        if fixable:
            reasons.append(
                f"{len(fixable)} fragmentation failure(s) in the last {window:.0f}s, but no node is below "
                "the restart thresholds now"
            )
        else:
            reasons.append("no allocation failures and no node past the fragmentation thresholds")
    if transient and action != "scale_up":
        reasons.append(
            f"{transient} capacity failure(s) in the last {window:.0f}s, but a node now has "
            f"{largest_node_free} tokens free: a passing peak, not a reason to scale up"
        )
    if busy_set and action == "none":
        action = "restart"  # keep autoscalers from scaling up while a restart is under way
        reasons = ["restarting now: " + ", ".join(sorted(busy_set)) + "; do not scale up meanwhile"]
    elif busy_set:
        reasons.append("restarting now: " + ", ".join(sorted(busy_set)))
    down = sorted(a.name for a in nodes if a.state in ("down", "stale"))
    if down:
        # Requests refused for want of a reachable node are not recorded as failures at all.
        reasons.append(
            f"{len(down)} node(s) down or not reporting ({', '.join(down)}): an outage, "
            "not a capacity shortage; bring them back rather than scale up"
        )
    for name in watch:
        w = next(a for a in nodes if a.name == name)
        ratio = w.largest_contiguous_free_block_ratio
        since = (
            f", below {cfg.restart_below_ratio:.2f} for {w.below_threshold_for_s:.0f}s of {cfg.restart_after_s:.0f}s"
            if w.below_threshold_for_s is not None
            else ""
        )
        reasons.append(f"watch {name}: largest block / free {ratio:.2f}{since}")
    return Advice(
        action=action,
        at=now,
        reasons=tuple(reasons),
        restart=tuple(ready) if action == "restart" else (),
        nodes=nodes,
        failures=failures_out,
        fleet=fleet_out,
        watch=watch,
    )
