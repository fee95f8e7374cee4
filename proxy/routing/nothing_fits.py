"""Why no backend can take a request: one per-node test, used by every place that says so.

An outage is not a capacity shortage, and a drained node is not fragmented. Each node is
first asked whether it could have taken the request at all, memory aside: up (reachable),
reporting freshly, not draining, not cooling down, not excluded (ejected, unhealthy, already
failed, or on the client's retry-key list). A node that could not is ``unavailable``, whatever
its memory figures say. Only the nodes that could have taken the request are judged on memory:
``fragmentation`` when one of them holds enough free memory in total (less pending
reservations) but no block big enough (a restart of that node fixes it), else ``capacity``.
When no node could take the request, the cause is ``unavailable``.

The gateway's 503, the allocation-failure metrics and their high-free-memory alert, and the
failure handed to the fleet's diagnosis and scaling advice all read this one verdict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.core.freshness import judged_at

Cause = Literal["unavailable", "fragmentation", "capacity"]


def why_unavailable(
    n: NodeView,
    now: float,
    stale_after_s: float,
    exclude: frozenset[str],
    judged: float | None = None,
) -> str | None:
    """Why ``n`` could not take any request now (memory aside), or None when it could."""
    if not n.up:
        return "down"
    if n.overlay.draining:
        return "draining"
    if now < n.overlay.cooldown_until:
        return "cooling down"
    if n.name in exclude:
        return "excluded"
    r = n.report
    if r is None:
        return "no memory report"
    if (now if judged is None else judged) - r.reported_at > stale_after_s:
        return "stale"
    return None


@dataclass(frozen=True, slots=True)
class NothingFits:
    """The verdict: the cause, the client's message and what the diagnosis needs."""

    cause: Cause
    message: str
    # Nodes that could have taken the request (memory aside).
    usable: tuple[str, ...]
    # Of those, the ones whose free memory in total holds the demand (fragmented).
    room_on: tuple[str, ...]
    # Free / capacity over the usable nodes (0 when none): the high-free-memory alert's input.
    free_fraction: float
    # Nodes up (reachable), and all nodes judged.
    reachable: int
    total: int


def judge(
    snapshot: FleetSnapshot,
    demand: int,
    now: float,
    *,
    stale_after_s: float = math.inf,
    exclude: Iterable[str] = (),
    names: Iterable[str] | None = None,
) -> NothingFits:
    """Why nothing in ``snapshot`` (or only ``names`` of it) takes ``demand`` tokens now."""
    keep = None if names is None else set(names)
    nodes = [n for n in snapshot.nodes if keep is None or n.name in keep]
    excluded = frozenset(exclude)
    # Staleness as ``eligible`` judges it (proxy.core.freshness); "down" etc. are not clocked.
    judged = judged_at(snapshot, now, stale_after_s) if math.isfinite(stale_after_s) else now
    reasons = {n.name: why_unavailable(n, now, stale_after_s, excluded, judged) for n in nodes}
    usable = [n for n in nodes if reasons[n.name] is None]
    reachable = sum(1 for n in nodes if n.up)
    cap = sum(n.report.capacity_tokens for n in usable if n.report is not None)
    free = sum(n.usable_free() for n in usable if n.report is not None)
    room = tuple(
        sorted(n.name for n in usable if n.report is not None and n.usable_free() >= demand)
    )
    fraction = free / cap if cap else 0.0
    if not usable:
        cause: Cause = "unavailable"
        message = _unavailable_message(nodes, reasons, reachable)
    elif room:
        cause = "fragmentation"
        best = max(n.usable_block() for n in usable)
        message = (
            f"no backend has a contiguous free block of {demand} tokens (largest {best}); "
            f"{', '.join(room)} had that much free in total: fragmentation, a restart frees it"
        )
    else:
        cause = "capacity"
        most = max(n.usable_free() for n in usable if n.report is not None)
        message = (
            f"no available backend has {demand} tokens free (most on one: {most}; "
            f"{len(usable)} available backends hold {free} tokens free, {100.0 * fraction:.0f}%): capacity"
        )
    return NothingFits(
        cause, message, tuple(n.name for n in usable), room, fraction, reachable, len(nodes)
    )


def _unavailable_message(
    nodes: list[NodeView], reasons: dict[str, str | None], reachable: int
) -> str:
    by_reason: dict[str, list[str]] = {}
    for n in nodes:
        by_reason.setdefault(reasons[n.name] or "available", []).append(n.name)
    detail = "; ".join(f"{why}: {', '.join(names)}" for why, names in sorted(by_reason.items()))
    return (
        f"no backend can take requests now: {reachable} of {len(nodes)} reachable ({detail}); "
        "an outage, not a capacity shortage"
    )


def nothing_fits_reason(
    snapshot: FleetSnapshot,
    demand: int,
    now: float,
    names: Iterable[str] | None = None,
    *,
    stale_after_s: float = math.inf,
    exclude: Iterable[str] = (),
) -> tuple[Cause, str]:
    """``(cause, message)`` of ``judge``."""
    verdict = judge(
        snapshot, demand, now, stale_after_s=stale_after_s, exclude=exclude, names=names
    )
    return verdict.cause, verdict.message
