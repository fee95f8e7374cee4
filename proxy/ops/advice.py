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
from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.ops.diagnosis import Failure, Level, Trend, level

Action = Literal["none", "restart", "scale_up"]
ACTIONS: tuple[Action, ...] = ("none", "restart", "scale_up")
RestartReason = Literal["fragmentation", "failures", "trend", "scheduled", "manual"]


@dataclass(frozen=True, slots=True)
class NodeAdvice:
    """One node as the advice sees it."""

    name: str
    pool: str
    state: str  # up | down | draining | stale | unknown
    level: Level
    largest_contiguous_free_block_ratio: float | None = None
    fragmentation_ratio: float | None = None
    free_fraction: float | None = None
    free_tokens: int | None = None
    largest_free_block_tokens: int | None = None
    uptime_s: float | None = None
    below_threshold_for_s: float | None = None
    trend_per_hour: float | None = None
    uptime_correlation: float | None = None
    restart_reasons: tuple[RestartReason, ...] = ()
    ready: bool = False  # the rest of the fleet can carry its load while it restarts
    why: str = ""

    @property
    def candidate(self) -> bool:
        return bool(self.restart_reasons)

    @property
    def reason(self) -> RestartReason:
        """The main reason, for the restarts counter."""
        return self.restart_reasons[0] if self.restart_reasons else "fragmentation"


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


def _state(n: NodeView, now: float, stale_after_s: float) -> str:
    if n.report is None:
        return "unknown" if n.up else "down"
    if not n.up:
        return "down"
    if n.overlay.draining:
        return "draining"
    if n.stale(now, stale_after_s):
        return "stale"
    return "up"


def healthy(n: NodeView, now: float, stale_after_s: float) -> bool:
    """Up, reporting freshly, not drained, not cooling down: takes traffic now."""
    return (
        n.up
        and n.report is not None
        and not n.stale(now, stale_after_s)
        and not n.overlay.draining
        and now >= n.overlay.cooldown_until
    )


def can_take_out(
    snapshot: FleetSnapshot,
    name: str,
    now: float,
    cfg: MaintenanceConfig,
    stale_after_s: float,
    busy: Iterable[str] = (),
) -> tuple[bool, str]:
    """Can the rest of the fleet carry ``name``'s traffic while it restarts?

    The rest: healthy nodes other than ``name`` and those already out (``busy``). They must
    keep at least ``min_healthy_capacity_fraction`` of the fleet's capacity, and their free
    memory must hold the tokens in flight on ``name`` through the gateways (its traffic).
    """
    out = set(busy) | {name}
    by_name = snapshot.by_name()
    node = by_name.get(name)
    total = sum(n.report.capacity_tokens for n in snapshot.nodes if n.report is not None)
    others = [n for n in snapshot.nodes if n.name not in out and healthy(n, now, stale_after_s)]
    if not others:
        return False, "no other healthy node to take its traffic"
    remaining = sum(n.report.capacity_tokens for n in others if n.report is not None)
    frac = remaining / total if total else 0.0
    if frac < cfg.min_healthy_capacity_fraction:
        return False, (
            f"without it the healthy nodes hold {frac:.0%} of the fleet's capacity, "
            f"below min_healthy_capacity_fraction {cfg.min_healthy_capacity_fraction:.0%}"
        )
    traffic = node.overlay.reserved_tokens if node is not None else 0
    spare = sum(n.usable_free() for n in others if n.report is not None)
    if spare < traffic:
        return False, f"the other nodes have {spare} tokens free for its {traffic} tokens in flight"
    return True, (
        f"{len(others)} other healthy node(s) keep {frac:.0%} of capacity with {spare} tokens free "
        f"for its {traffic} tokens in flight"
    )


def update_below_since(
    previous: Mapping[str, float], snapshot: FleetSnapshot, now: float, cfg: MaintenanceConfig
) -> dict[str, float]:
    """Since when each node has been below ``restart_below_ratio`` (nodes above it drop out)."""
    out: dict[str, float] = {}
    for n in snapshot.nodes:
        r = n.report
        if r is None or not n.up:
            continue
        if (
            r.free_fraction > cfg.min_free_fraction
            and r.largest_block_ratio < cfg.restart_below_ratio
        ):
            out[n.name] = previous.get(n.name, now)
    return out


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


def _assess(
    n: NodeView,
    now: float,
    cfg: MaintenanceConfig,
    stale_after_s: float,
    trend: Trend | None,
    below_since: float | None,
    failed_demand_here: int,
    blocked_until: float | None = None,
) -> NodeAdvice:
    r = n.report
    state = _state(n, now, stale_after_s)
    if r is None:
        return NodeAdvice(n.name, n.pool, state, level(None, cfg.min_free_fraction))
    uptime = r.uptime(now) if r.started_at > 0 else None
    below_for = now - below_since if below_since is not None else None
    reasons: list[RestartReason] = []
    if below_for is not None and below_for >= cfg.restart_after_s:
        reasons.append("fragmentation")
    if failed_demand_here and r.largest_free_block_tokens < failed_demand_here <= r.free_tokens:
        reasons.append("failures")  # it still has the memory for what failed, and still no block
    if cfg.restart_on_trend and trend is not None and trend.rising:
        reasons.append("trend")
    if (
        cfg.scheduled_restart_uptime_s is not None
        and uptime is not None
        and uptime >= cfg.scheduled_restart_uptime_s
    ):
        reasons.append("scheduled")
    why = ""
    if reasons and state != "up":
        why = f"node is {state}"
        reasons = []
    elif reasons and uptime is not None and uptime < cfg.min_interval_per_node_s:
        why = f"restarted {uptime:.0f}s ago, min_interval_per_node_s is {cfg.min_interval_per_node_s:.0f}"
        reasons = []
    elif reasons and blocked_until is not None and now < blocked_until:
        why = f"a recent restart attempt: next one allowed in {blocked_until - now:.0f}s"
        reasons = []
    return NodeAdvice(
        name=n.name,
        pool=n.pool,
        state=state,
        level=level(r, cfg.min_free_fraction),
        largest_contiguous_free_block_ratio=round(r.largest_block_ratio, 4),
        fragmentation_ratio=round(r.fragmentation, 4),
        free_fraction=round(r.free_fraction, 4),
        free_tokens=r.free_tokens,
        largest_free_block_tokens=r.largest_free_block_tokens,
        uptime_s=round(uptime, 3) if uptime is not None else None,
        below_threshold_for_s=round(below_for, 3) if below_for is not None else None,
        trend_per_hour=trend.slope_per_hour if trend is not None else None,
        uptime_correlation=trend.correlation if trend is not None else None,
        restart_reasons=tuple(reasons),
        why=why,
    )


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

    assessed = [
        _assess(
            n,
            now,
            cfg,
            stale_after_s,
            trends.get(n.name),
            below_since.get(n.name),
            failed_here.get(n.name, 0),
            blocked_until.get(n.name),
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
        "healthy_nodes": sum(1 for n in snapshot.nodes if healthy(n, now, stale_after_s)),
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
