"""The kvroute policy: length- and fragmentation-aware placement (see ``KvroutePolicy``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.routing.affinity import demand_on, prefer_cached
from proxy.routing.expected_ttft import by_expected_ttft
from proxy.routing.policy import Policy, PolicySettings, RequestClass, RouteRequest, eligible
from proxy.routing.queueing import queue_load, queued_ahead, slot_limits_known, slot_turns


@dataclass(frozen=True, slots=True)
class KvrouteWeights:
    """Weights of the short-request score (lower is better)."""

    load: float = 0.6  # how full the node is (after pending reservations)
    freshness: float = 0.4  # penalty for nodes that still have their big blocks whole
    inflight: float = 0.002  # tie-break per request in flight


def _utilisation(n: NodeView) -> float:
    r = n.report
    if r is None or r.capacity_tokens <= 0:
        return 1.0
    return 1.0 - n.usable_free() / r.capacity_tokens


def _fragmentation(n: NodeView) -> float:
    return n.report.fragmentation if n.report is not None else 1.0


def _queueing(n: NodeView) -> bool:
    return n.report is not None and n.report.queueing


def _queue_key(
    n: NodeView, cls: RequestClass, turns: bool
) -> tuple[float, bool, float, float, str]:
    """Order of queueing (paged) nodes: a free slot first, the request's own pool first.

    No blocks to keep whole there: what delays the first token is the queue. Nodes with a
    free slot come first, the request's pool (long pool for long requests, general for
    short) before the other; then the fewest slot turns to wait, the fewest requests per
    engine, the least KV in use. So a pool whose slots are all taken spills to a node that
    can start the request now, and back as soon as a slot frees (no hysteresis).

    Slot turns count only where every node compared has a known slot limit (``turns``;
    ``slot_limits_known``): a node whose limit is unknown has 0 turns however many
    requests it holds, so beside nodes with a known limit it looked free to every request.
    """
    own = "long" if cls == "long" else "general"
    waits = slot_turns(n) if turns else 0.0
    return (waits, n.role != own, queue_load(n), _utilisation(n), n.name)


def _blind_key(n: NodeView) -> tuple[int, int, str]:
    """Least outstanding requests, then tokens, on this replica's own count: what vllm-router's
    blind policies compare, and what the ranking falls back to while its predictions miss."""
    return (n.overlay.inflight, n.overlay.reserved_tokens, n.name)


def _takes(n: NodeView, demand: int, now: float, margin: float) -> bool:
    """Fit, except that a queueing node whose slots alone are full still takes work.

    Its KV has room and its FIFO queue starts the request as soon as a slot frees; it ranks
    by its queue (``queue_load``) against the others. Excluding it (for the pressure
    hysteresis, 5 s) herded every request onto the nodes left, or short requests into the
    long pool (measured: docs/benchmarks.md section 7).
    """
    if n.overlay.pressure == "slots" and _queueing(n):
        n = replace(n, overlay=replace(n.overlay, pressure=""))
    return n.fits(demand, now, margin)


def _waits(n: NodeView, demand: int, now: float, margin: float) -> bool:
    """A node where the request would wait in the server's own queue: no slot free for it now.

    Every slot taken, by the report or by the gateway's count (``slot_turns``: its flights
    that llama.cpp's ``/slots`` does not show yet hold slots too), where the report gives
    the slot count (``max_num_seqs``); or, on a server that queues what one slot holds
    (llama.cpp's partitioned slots, ``NodeView.queued_block``), no idle slot that holds it.
    Queueing (paged) servers have their own order (``_queue_key``).
    """
    if _queueing(n):
        return False
    return slot_turns(n) > 0 or (n.queued_block() > 0 and not n.fits_now(demand, now, margin))


@dataclass
class KvroutePolicy(Policy):
    """Length- and fragmentation-aware placement.

    Long requests: the long pool first, best fit on the largest free block (the tightest
    block that holds it) so the biggest blocks stay whole for the next long request; then
    the general nodes, best fit again. Short requests: the general pool, preferring nodes
    whose memory is already broken into gaps and away from nodes that still hold big blocks,
    balanced by load; the long pool only when no general node fits. The long pool is thus
    the set of nodes kept free of short-request churn, which is what fragments a contiguous
    allocator.

    Why best fit for the general spill too, rather than the freshest general node: in the
    offline simulator (docs/simulator.md: problem statement's mix, 8 contiguous nodes, 55%
    load, no admission queue, 3 seeds x 6 h) it failed 31% fewer requests with a long pool
    of 4 nodes (0.137% vs 0.200%) and the same with 7 (0.089%). A fresh node's one big
    block is worth more to the next long request than to this one.

    Queueing, paged servers (vLLM, SGLang, TGI: ``report.queueing``) have no blocks to keep
    whole and a waiting queue instead of failures: they are ordered by their queues
    (``_queue_key``: a free slot first, the request's own pool first among those), and a
    node whose slots alone are full still takes work (``_takes``).

    A contiguous server that defers rather than refuses what one slot holds (llama.cpp's
    partitioned slots, ``report.queued_up_to_tokens``) takes such a request with every slot
    busy: it waits in that server's queue, not at the gateway until ``/slots`` shows room
    (seconds late on a loaded CPU). Such nodes, and those with room but every slot taken by
    the gateway's count (``_waits``), come after every node that starts the request now, the
    fewest slot turns first, and only where the request is the next in line: further back
    it is held at the gateway, which places it on whichever server makes room first. On
    the llama.cpp benchmark (docs/results.md), joining any queue sent the documents that
    only the 2,048-token slots hold 11 deep there while the other servers sat idle for the
    run's last 50 s (goodput 0.50 requests/s); next in line only, 0.68-0.71.

    Prefix-cache and session affinity (``proxy.routing.affinity``) then move the nodes that
    fit and probably hold this prompt's prefix ahead of that order, unless they are loaded;
    among queueing servers a node whose expected TTFT (prefill backlog plus the prompt's
    uncached tokens, ``proxy.routing.expected_ttft``) is beyond the best by the slack yields.
    """

    settings: PolicySettings = field(default_factory=PolicySettings)
    weights: KvrouteWeights = field(default_factory=KvrouteWeights)
    name: str = "kvroute"
    checks_fit: bool = True

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        margin = self.settings.safety_margin
        affinity = self.settings.affinity
        cached = req.cached
        fit: list[NodeView] = []
        waiting: list[NodeView] = []
        unknown: list[NodeView] = []
        for n in eligible(snapshot, req, now, self.settings):
            r = n.report
            # Cached prefix blocks that the server reuses are not allocated again.
            demand = demand_on(n, req.demand, cached, affinity) if cached else req.demand
            if r is None:
                unknown.append(n)
            # Neither a usable block nor the server's queue holds it: it can never fit (margin
            # and block rounding only add), so fits() is skipped.
            elif (
                r.largest_free_block_tokens - n.overlay.pending_tokens >= demand
                or r.queued_up_to_tokens >= demand
            ) and _takes(n, demand, now, margin):
                if not _waits(n, demand, now, margin):
                    fit.append(n)
                elif not queued_ahead(n):
                    # Next in that server's line; further back, held (the class docstring).
                    waiting.append(n)
        ordered = self._order(fit, req)
        if waiting:
            # After every node that starts it now: the fewest slot turns to wait (the slots'
            # queue, the gateway's flights counted), today's order among equals.
            ordered += sorted(self._order(waiting, req), key=slot_turns)
        # No affinity or expected-TTFT reordering while the model misses (``req.blind``).
        if not req.blind and (cached or req.session_node is not None or req.indexed is not None):
            ordered = prefer_cached(ordered, cached, req.session_node, affinity, req.indexed)
        if req.ttft is not None and not req.blind:
            # A cached node whose prefill queue costs more than recomputing elsewhere yields.
            ordered = by_expected_ttft(ordered, req.ttft, req.ttft_slack_s)
        # Nodes with no report: nothing to fit against, so last; by length only (pool role).
        want = "long" if req.cls == "long" else "general"
        unknown.sort(key=lambda n: (n.role != want, n.overlay.inflight, n.name))
        return [n.name for n in ordered] + [n.name for n in unknown]

    def _order(self, fit: list[NodeView], req: RouteRequest) -> list[NodeView]:
        """``fit`` best first, before affinity: contiguous nodes by length (best fit for long
        requests, the most broken-up memory for short ones), queueing nodes after them."""
        queued = [n for n in fit if _queueing(n)]
        if queued:
            # Queueing nodes by their queues (``_queue_key``; ``_blind_key`` while the model
            # misses), after any that allocate at admission (contiguous order kept for those).
            turns = slot_limits_known(queued)
            queued.sort(key=_blind_key if req.blind else lambda n: _queue_key(n, req.cls, turns))
            fit = [n for n in fit if not _queueing(n)]
        if req.cls == "long":
            # Long pool first; in each, the tightest block that holds it (the largest blocks
            # stay whole for the largest requests).
            fit.sort(key=lambda n: (n.role != "long", n.usable_block(), n.overlay.inflight, n.name))
            return fit + queued
        long_pool = [n for n in fit if n.role == "long"]
        general = [n for n in fit if n.role != "long"]
        w = self.weights
        threshold = self.settings.long_threshold_tokens

        def short_score(n: NodeView) -> tuple[float, str]:
            # A node whose largest block could still hold a long request is "fresh": keep it so.
            fresh = 1.0 - _fragmentation(n) if n.usable_block() >= threshold else 0.0
            score = w.load * _utilisation(n) + w.freshness * fresh
            return (score + w.inflight * n.overlay.inflight, n.name)

        general.sort(key=short_score)
        # Spill: least harm where most room.
        long_pool.sort(key=lambda n: (-n.usable_block(), n.name))
        return general + long_pool + queued
