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

from collections.abc import Collection, Iterable, Mapping
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


@dataclass(frozen=True, slots=True)
class Findings:
    """What ``decide`` found and chose: every number the explanation quotes, no text."""

    action: Action
    window_s: float
    fixable: tuple[Failure, ...]  # fragmentation failures of the window
    capacity: tuple[Failure, ...]  # capacity failures of the window
    capacity_still_short: int  # capacity failures no node could take even now
    transient: int  # capacity failures some node could take now (a passing peak)
    candidates: tuple[NodeAdvice, ...]  # restart candidates, most fragmented first, judged
    busy: frozenset[str]  # nodes being restarted now
    nodes: tuple[NodeAdvice, ...]
    watch: tuple[str, ...]
    ready: tuple[str, ...]
    failures: Mapping[str, float]
    fleet: Mapping[str, float]


def _failed_here(fixable: Iterable[Failure]) -> dict[str, int]:
    """The largest fragmentation failure each node had room for (but no block)."""
    out: dict[str, int] = {}
    for f in fixable:
        for name in f.room_on:
            out[name] = max(out.get(name, 0), f.demand)
    return out


def _judge_candidates(
    snapshot: FleetSnapshot,
    assessed: list[NodeAdvice],
    now: float,
    cfg: MaintenanceConfig,
    stale_after_s: float,
    busy: frozenset[str],
) -> tuple[tuple[NodeAdvice, ...], tuple[str, ...]]:
    """Candidates, most fragmented first, each ready only if the fleet can spare it on top
    of those before (and of the restarts under way); the ready ones in order."""
    ordered = sorted(
        (a for a in assessed if a.candidate and a.name not in busy),
        key=lambda a: (a.largest_contiguous_free_block_ratio or 0.0, a.name),
    )
    taken = set(busy)
    ready: list[str] = []
    judged: list[NodeAdvice] = []
    for a in ordered:
        ok, why = can_take_out(snapshot, a.name, now, cfg, stale_after_s, taken)
        if ok and len(taken) < cfg.max_concurrent_restarts:
            taken.add(a.name)
            ready.append(a.name)
        elif ok:
            why = f"waiting: {len(taken)} node(s) restarting or going first (max_concurrent_restarts {cfg.max_concurrent_restarts})"
            ok = False
        judged.append(NodeAdvice(**{**asdict(a), "ready": ok, "why": why}))
    return tuple(judged), tuple(ready)


def _watched(nodes: Iterable[NodeAdvice], trends: Mapping[str, Trend]) -> tuple[str, ...]:
    """Nodes fragmenting (high, severe or rising) but not yet restart candidates."""
    return tuple(
        a.name
        for a in nodes
        if not a.candidate
        and a.state == "up"
        and (
            a.level in ("high", "severe")
            or (trends.get(a.name) is not None and trends[a.name].rising)
        )
    )


def _still_fragmented(snapshot: FleetSnapshot, f: Failure) -> bool:
    """A fragmentation failure stands while a node it names still has the memory for it and
    no block (not once that node restarted, or filled up)."""
    by_name = snapshot.by_name()
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


def _fleet_numbers(
    snapshot: FleetSnapshot, now: float, stale_after_s: float, judged: float, demand: int
) -> dict[str, float]:
    # A down node's last report is not fleet memory.
    reporting = [n for n in snapshot.nodes if n.up and n.report is not None]
    reports = [n.report for n in reporting if n.report is not None]
    cap_total = sum(r.capacity_tokens for r in reports)
    free_total = sum(r.free_tokens for r in reports)
    return {
        "nodes": len(snapshot.nodes),
        "healthy_nodes": sum(1 for n in snapshot.nodes if healthy(n, now, stale_after_s, judged)),
        "capacity_tokens": cap_total,
        "free_tokens": free_total,
        "free_fraction": round(free_total / cap_total, 4) if cap_total else 0.0,
        "largest_free_block_tokens": max((r.largest_free_block_tokens for r in reports), default=0),
        "largest_node_free_tokens": max((n.usable_free() for n in reporting), default=0),
        "effective_demand_tokens": demand,
        "effective_utilisation": round(demand / cap_total, 4) if cap_total else 0.0,
    }


def _failure_numbers(
    fails: list[Failure], fixable: list[Failure], capacity: list[Failure], window: float
) -> dict[str, float]:
    return {
        "window_s": window,
        "total": len(fails),
        "fragmentation": len(fixable),
        "capacity": len(capacity),
        "at_high_free_memory": sum(1 for f in fails if f.at_high_free),
        "max_fragmentation_demand_tokens": max((f.demand for f in fixable), default=0),
        "max_capacity_demand_tokens": max((f.demand for f in capacity), default=0),
    }


def decide(
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
    split_by_config: Collection[str] = (),
) -> Findings:
    """The action and what it rests on (parameters as ``advise``)."""
    fails = list(failures)
    trends = trends or {}
    busy_set = frozenset(busy)
    fixable = [f for f in fails if f.fixable_by_restart]
    capacity = [f for f in fails if not f.fixable_by_restart]
    # A restart does not join split slots (proxy.ops.slot_advice says what does).
    failed_here = {
        name: demand
        for name, demand in _failed_here(fixable).items()
        if name not in split_by_config
    }
    # Staleness judged as routing judges it (proxy.core.freshness): against the newest report.
    judged = judged_at(snapshot, now, stale_after_s)
    assessed = [
        assess(
            n, now, cfg, stale_after_s, trends.get(n.name), (below_since or {}).get(n.name),
            failed_here.get(n.name, 0), (blocked_until or {}).get(n.name), judged,
        )
        for n in snapshot.nodes
    ]  # fmt: skip
    candidates, ready = _judge_candidates(snapshot, assessed, now, cfg, stale_after_s, busy_set)
    by_name = {a.name: a for a in candidates}
    nodes = tuple(by_name.get(a.name, a) for a in assessed)
    demand = effective_demand_tokens(snapshot, fails if rate_failures is None else rate_failures)
    fleet = _fleet_numbers(snapshot, now, stale_after_s, judged, demand)
    # A capacity failure still stands while no node has that much free memory; once one has
    # (requests finished), it was a peak, and adding replicas for it would be premature.
    short = sum(1 for f in capacity if f.demand > fleet["largest_node_free_tokens"])
    still_fragmented = sum(1 for f in fixable if _still_fragmented(snapshot, f))
    numbers = _failure_numbers(fails, fixable, capacity, cfg.failure_window_s)
    numbers["capacity_still_short"] = short
    numbers["fragmentation_still_fragmented"] = still_fragmented
    action: Action = "none"
    if short and short >= still_fragmented:
        action = "scale_up"
    elif candidates or busy_set:
        # While a restart is under way, "restart" keeps autoscalers from scaling up.
        action = "restart"
    return Findings(
        action, cfg.failure_window_s, tuple(fixable), tuple(capacity), short,
        len(capacity) - short, candidates, busy_set, nodes, _watched(nodes, trends),
        ready if action == "restart" else (), numbers, fleet,
    )  # fmt: skip


def _scale_up_reasons(f: Findings) -> list[str]:
    fleet, window = f.fleet, f.window_s
    out = [
        f"{f.capacity_still_short} allocation failure(s) in the last {window:.0f}s were capacity: demand up to "
        f"{f.failures['max_capacity_demand_tokens']} tokens exceeds the total free memory of every node "
        f"(most free on one node now: {fleet['largest_node_free_tokens']}; fleet free "
        f"{fleet['free_tokens']} of {fleet['capacity_tokens']})"
    ]
    if f.fixable:
        out.append(
            f"{len(f.fixable)} other failure(s) were fragmentation: restart those nodes as well"
        )
    out.append(
        f"effective demand {fleet['effective_demand_tokens']} tokens of {fleet['capacity_tokens']} "
        f"({fleet['effective_utilisation']:.0%})"
    )
    return out


def _restart_reasons(f: Findings) -> list[str]:
    out = []
    for a in f.candidates:
        uptime = a.uptime_s if a.uptime_s is not None else "?"
        out.append(
            f"{a.name} ({', '.join(a.restart_reasons)}): largest free block {a.largest_free_block_tokens} of "
            f"{a.free_tokens} free tokens (ratio {a.largest_contiguous_free_block_ratio:.2f}, "
            f"{(a.free_fraction or 0):.0%} free), uptime {uptime}s; "
            + ("ready: " if a.ready else "not yet: ")
            + a.why
        )
    if f.fixable:
        out.append(
            f"{len(f.fixable)} allocation failure(s) in the last {f.window_s:.0f}s were fragmentation: a node "
            f"had enough free memory in total but no block of up to "
            f"{f.failures['max_fragmentation_demand_tokens']} tokens; "
            "a restart restores it, more replicas would not be needed"
        )
    else:
        out.append("no capacity failures: do not scale up")
    return out


def _quiet_reasons(f: Findings) -> list[str]:
    if f.fixable:
        return [
            f"{len(f.fixable)} fragmentation failure(s) in the last {f.window_s:.0f}s, but no node is below "
            "the restart thresholds now"
        ]
    return ["no allocation failures and no node past the fragmentation thresholds"]


def _context_reasons(f: Findings, cfg: MaintenanceConfig) -> list[str]:
    """What every answer adds: restarts under way, nodes down, nodes to watch."""
    out = []
    if f.busy:
        out.append("restarting now: " + ", ".join(sorted(f.busy)))
    down = sorted(a.name for a in f.nodes if a.state in ("down", "stale"))
    if down:
        # Requests refused for want of a reachable node are not recorded as failures at all.
        out.append(
            f"{len(down)} node(s) down or not reporting ({', '.join(down)}): an outage, "
            "not a capacity shortage; bring them back rather than scale up"
        )
    for name in f.watch:
        w = next(a for a in f.nodes if a.name == name)
        since = (
            f", below {cfg.restart_below_ratio:.2f} for {w.below_threshold_for_s:.0f}s of {cfg.restart_after_s:.0f}s"
            if w.below_threshold_for_s is not None
            else ""
        )
        out.append(
            f"watch {name}: largest block / free {w.largest_contiguous_free_block_ratio:.2f}{since}"
        )
    return out


def explain(f: Findings, cfg: MaintenanceConfig) -> tuple[str, ...]:
    """The reasons an operator reads in ``/fleet/advice``, from what ``decide`` found."""
    if f.action == "restart" and not f.candidates:
        # Only restarts under way: their line says it all ("restarting now" comes first).
        head = [f"restarting now: {', '.join(sorted(f.busy))}; do not scale up meanwhile"]
        return tuple(head + _context_reasons(f, cfg)[1:])
    if f.action == "scale_up":
        reasons = _scale_up_reasons(f)
    elif f.action == "restart":
        reasons = _restart_reasons(f)
    else:
        reasons = _quiet_reasons(f)
    if f.transient and f.action != "scale_up":
        reasons.append(
            f"{f.transient} capacity failure(s) in the last {f.window_s:.0f}s, but a node now has "
            f"{f.fleet['largest_node_free_tokens']} tokens free: a passing peak, not a reason to scale up"
        )
    return tuple(reasons + _context_reasons(f, cfg))


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
    split_by_config: Collection[str] = (),
) -> Advice:
    """What to do now, and why. ``failures``: those of the last ``failure_window_s``;
    ``rate_failures``: those of the last minute, for the effective demand (defaults to
    ``failures``); ``busy``: nodes being restarted now (they count as out of the fleet);
    ``blocked_until``: no restart of a node before this time (its last attempt, from the
    shared event log); ``split_by_config``: nodes whose free memory is split by how they
    were started (llama.cpp's partitioned slots), never restart candidates. ``decide``
    chooses, ``explain`` writes the reasons."""
    found = decide(
        snapshot, now, cfg, stale_after_s=stale_after_s, failures=failures,
        rate_failures=rate_failures, trends=trends, below_since=below_since, busy=busy,
        blocked_until=blocked_until, split_by_config=split_by_config,
    )  # fmt: skip
    return Advice(
        action=found.action,
        at=now,
        reasons=explain(found, cfg),
        restart=found.ready,
        nodes=found.nodes,
        failures=found.failures,
        fleet=found.fleet,
        watch=found.watch,
    )
