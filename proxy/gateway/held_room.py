"""The room kept for a held request that newer ones overtook too often (``proxy.core.aging``).

A starving request names one node, the one it is nearest to fitting on, and newer requests
stop taking that node until it is placed; they still take the others, and that node too
when they are expected to end before its room frees (backfilling). Each look a held or new
request takes at the fleet goes through ``nodes_kept``: it names the node for a starving
request that has none yet (or whose node it may no longer use), refreshes when that node's
room frees, and tells the caller which nodes to leave alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.core.projection import steps_until_free
from proxy.gateway.hold_prefill import prefill_pending

if TYPE_CHECKING:
    from proxy.gateway.context import RequestContext
    from proxy.gateway.memory_pressure import MemoryPressure


def nearest(nodes: Iterable[NodeView], skip: frozenset[str]) -> str | None:
    """The node (up, reporting, not in ``skip``) with the most room for the request now."""
    best: tuple[int, str] | None = None
    for n in nodes:
        if n.name in skip or not n.up or n.report is None:
            continue
        key = (n.usable_block(), n.name)
        if best is None or key > best:
            best = key
    return best[1] if best is not None else None


def free_in(pressure: MemoryPressure, ctx: RequestContext, node: NodeView | None) -> float:
    """Decode steps until ``node``'s flights free the room ``ctx`` lacks there (inf: unknown).

    Only where the projection counts the node (a lazily allocating server, whose flights
    free their room as they end); a contiguous server's blocks are no such promise.
    """
    if node is None or node.overlay.projected_tokens is None:
        return math.inf
    deficit = ctx.demand - node.usable_block()
    return steps_until_free(pressure.flights.get(node.name, {}).values(), deficit)


def own_steps(pressure: MemoryPressure, ctx: RequestContext) -> float:
    """Decode steps ``ctx`` is expected to run (its learned output; inf without a projection)."""
    return float(pressure.flight_for(ctx).remaining) if pressure.enabled else math.inf


def kept_for(pressure: MemoryPressure, ctx: RequestContext) -> frozenset[str]:
    """The nodes kept for older starving requests that ``ctx`` would delay."""
    if not len(pressure.order):
        return frozenset()
    return pressure.order.kept(ctx.reservation_id, own_steps(pressure, ctx))


def nodes_kept(
    pressure: MemoryPressure, ctx: RequestContext, view: FleetSnapshot, exclude: frozenset[str]
) -> frozenset[str] | None:
    """The nodes ``ctx`` must leave alone; None: it may place nowhere now.

    ``view``: the fleet as ``ctx`` ranks it (its own projection laid over); ``exclude``: the
    nodes it may not use anyway (down, tried, ruled out).
    """
    order = pressure.order
    if not len(order):
        # Nothing held (the common case): nothing kept.
        return frozenset()
    key = ctx.reservation_id
    target = order.target(key)
    if order.needs_target(key) or (target is not None and target in exclude):
        older = order.kept(key)
        # A node no older starving request waits for; else share one (next in its line).
        target = nearest(view.nodes, exclude | older) or nearest(view.nodes, exclude)
    if target is not None:
        node = next((n for n in view.nodes if n.name == target), None)
        order.keep(key, target, free_in(pressure, ctx, node))
    if not order.may_place(key) or prefill_pending(ctx):
        # A long two-step request computes its prompt first while others are held: a decode
        # room reserved before that would stay empty (``proxy.gateway.hold_prefill``).
        return None
    return kept_for(pressure, ctx)
