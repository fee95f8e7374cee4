"""Per-node assessment for the advice: is this node a restart candidate, and can it go now?

Pure. The fleet-level answer (``proxy.ops.advice``: none / restart / scale_up, the effective
demand) is built from these per-node verdicts; keeping them apart lets the maintenance loop
ask ``can_take_out`` and track ``update_below_since`` without the whole advice, and keeps
each rule short enough to read against docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from proxy.config import MaintenanceConfig
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView
from proxy.core.freshness import judged_at
from proxy.ops.diagnosis import Level, Trend, level

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


def _state(n: NodeView, judged: float, stale_after_s: float) -> str:
    if n.report is None:
        return "unknown" if n.up else "down"
    if not n.up:
        return "down"
    if n.overlay.draining:
        return "draining"
    if n.stale(judged, stale_after_s):
        return "stale"
    return "up"


def healthy(n: NodeView, now: float, stale_after_s: float, judged: float | None = None) -> bool:
    """Up, reporting freshly, not drained, not cooling down: takes traffic now.

    ``judged``: the time staleness is judged at (``proxy.core.freshness.judged_at`` of the
    node's snapshot), so a gateway whose loop runs late does not find every node stale at
    once, as routing does not; without it, ``now``.
    """
    return (
        n.up
        and n.report is not None
        and not n.stale(now if judged is None else judged, stale_after_s)
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
    judged = judged_at(snapshot, now, stale_after_s)
    others = [
        n for n in snapshot.nodes if n.name not in out and healthy(n, now, stale_after_s, judged)
    ]
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
    previous: Mapping[str, float],
    snapshot: FleetSnapshot,
    now: float,
    cfg: MaintenanceConfig,
    split_by_config: Collection[str] = (),
) -> dict[str, float]:
    """Since when each node has been below ``restart_below_ratio`` (nodes above it drop out).

    ``split_by_config``: nodes whose free memory is split by how they were started, not by
    use (llama.cpp's partitioned slots): a restart joins nothing there, so they never count.
    """
    out: dict[str, float] = {}
    for n in snapshot.nodes:
        r = n.report
        if r is None or not n.up or n.name in split_by_config:
            continue
        if (
            r.free_fraction > cfg.min_free_fraction
            and r.largest_block_ratio < cfg.restart_below_ratio
        ):
            out[n.name] = previous.get(n.name, now)
    return out


def _restart_reasons(
    r: MemoryReport,
    cfg: MaintenanceConfig,
    trend: Trend | None,
    below_for: float | None,
    failed_demand_here: int,
    uptime: float | None,
) -> list[RestartReason]:
    """Why a restart would help this node, whether or not one is allowed now."""
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
    return reasons


def _held_back(
    state: str,
    cfg: MaintenanceConfig,
    uptime: float | None,
    now: float,
    blocked_until: float | None,
) -> str:
    """Why a node with reasons to restart may not be restarted now ("" when it may)."""
    if state != "up":
        return f"node is {state}"
    if uptime is not None and uptime < cfg.min_interval_per_node_s:
        return f"restarted {uptime:.0f}s ago, min_interval_per_node_s is {cfg.min_interval_per_node_s:.0f}"
    if blocked_until is not None and now < blocked_until:
        return f"a recent restart attempt: next one allowed in {blocked_until - now:.0f}s"
    return ""


def assess(
    n: NodeView,
    now: float,
    cfg: MaintenanceConfig,
    stale_after_s: float,
    trend: Trend | None,
    below_since: float | None,
    failed_demand_here: int,
    blocked_until: float | None = None,
    judged: float | None = None,
) -> NodeAdvice:
    """One node's level, figures and restart reasons (``ready`` is decided fleet-wide).

    ``judged``: the time its staleness is judged at (see ``healthy``); without it, ``now``.
    """
    r = n.report
    state = _state(n, now if judged is None else judged, stale_after_s)
    if r is None:
        return NodeAdvice(n.name, n.pool, state, level(None, cfg.min_free_fraction))
    uptime = r.uptime(now) if r.started_at > 0 else None
    below_for = now - below_since if below_since is not None else None
    reasons = _restart_reasons(r, cfg, trend, below_for, failed_demand_here, uptime)
    why = _held_back(state, cfg, uptime, now, blocked_until) if reasons else ""
    if why:
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
