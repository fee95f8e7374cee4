"""Routing policy: classify a request and rank the backends for it.

Pure and deterministic: a fleet snapshot, a request and the time go in, an ordered list
of backend names comes out. The gateway and the offline fleet simulator run this same
code, so what the simulator shows is what the gateway does.

``kvroute`` is the fragmentation-aware policy; ``round_robin``, ``least_loaded`` and
``most_free`` are what peer routers do, kept selectable so operators can A/B them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Literal

from proxy.core.fleet import FleetSnapshot, NodeView

# Re-exported: the one per-node test of why nothing fits lives in its own module.
from proxy.routing.nothing_fits import nothing_fits_reason as nothing_fits_reason

RequestClass = Literal["short", "long"]


def classify(demand_tokens: int, long_threshold_tokens: int) -> RequestClass:
    """Long at or above the threshold. Demand (prompt + max new tokens) is what the KV cache holds."""
    return "long" if demand_tokens >= long_threshold_tokens else "short"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    demand: int
    cls: RequestClass
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PolicySettings:
    safety_margin: float = 0.02
    stale_after_s: float = 5.0
    long_threshold_tokens: int = 8_000


@dataclass(frozen=True, slots=True)
class KvrouteWeights:
    """Weights of the short-request score (lower is better)."""

    load: float = 0.6  # how full the node is (after pending reservations)
    freshness: float = 0.4  # penalty for nodes that still have their big blocks whole
    inflight: float = 0.002  # tie-break per request in flight


def eligible(
    snapshot: FleetSnapshot, req: RouteRequest, now: float, settings: PolicySettings
) -> list[NodeView]:
    """Nodes a request may go to at all: up, not draining, not cooling down, not already failed.

    A node whose report is stale is excluded only when it has a report: a backend with no
    report at all (e.g. a vLLM server whose metrics are not scraped) stays routable as "unknown".
    """
    out: list[NodeView] = []
    exclude = req.exclude
    stale_after = settings.stale_after_s
    for n in snapshot.nodes:
        ov = n.overlay
        if not n.up or ov.draining or now < ov.cooldown_until or (exclude and n.name in exclude):
            continue
        r = n.report
        if r is not None and now - r.reported_at > stale_after:  # NodeView.stale, inlined: hot path
            continue
        out.append(n)
    return out


def _utilisation(n: NodeView) -> float:
    r = n.report
    if r is None or r.capacity_tokens <= 0:
        return 1.0
    return 1.0 - max(0, r.free_tokens - n.overlay.pending_tokens) / r.capacity_tokens


def _fragmentation(n: NodeView) -> float:
    return n.report.fragmentation if n.report is not None else 1.0


class Policy(abc.ABC):
    """Ranks backends for one request. `checks_fit` says whether it reads memory state at all."""

    name: str = "abstract"
    checks_fit: bool = True

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()

    @abc.abstractmethod
    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        """Backend names, best first. Empty when nothing can take the request now."""


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
    """

    settings: PolicySettings = field(default_factory=PolicySettings)
    weights: KvrouteWeights = field(default_factory=KvrouteWeights)
    name: str = "kvroute"
    checks_fit: bool = True

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        margin = self.settings.safety_margin
        demand = req.demand
        fit: list[NodeView] = []
        unknown: list[NodeView] = []
        for n in eligible(snapshot, req, now, self.settings):
            r = n.report
            if r is None:
                unknown.append(n)
            # usable block < demand can never fit (margin and block rounding only add): skip fits()
            elif r.largest_free_block_tokens - n.overlay.pending_tokens >= demand and n.fits(
                demand, now, margin
            ):
                fit.append(n)

        if req.cls == "long":
            # Long pool first; in each, the tightest block that holds it (the largest blocks
            # stay whole for the largest requests).
            fit.sort(key=lambda n: (n.role != "long", n.usable_block(), n.overlay.inflight, n.name))
            ordered = fit
        else:
            long_pool = [n for n in fit if n.role == "long"]
            general = [n for n in fit if n.role != "long"]
            w = self.weights
            threshold = self.settings.long_threshold_tokens

            def short_score(n: NodeView) -> tuple[float, str]:
                # A node whose largest block could still hold a long request is "fresh": keep it so.
                fresh = 1.0 - _fragmentation(n) if n.usable_block() >= threshold else 0.0
                return (
                    w.load * _utilisation(n)
                    + w.freshness * fresh
                    + w.inflight * n.overlay.inflight,
                    n.name,
                )

            general.sort(key=short_score)
            long_pool.sort(
                key=lambda n: (-n.usable_block(), n.name)
            )  # spill: least harm where most room
            ordered = general + long_pool
        # Nodes with no report: nothing to fit against, so last; by length only (pool role).
        want = "long" if req.cls == "long" else "general"
        unknown.sort(key=lambda n: (n.role != want, n.overlay.inflight, n.name))
        return [n.name for n in ordered] + [n.name for n in unknown]


@dataclass
class RoundRobinPolicy(Policy):
    """Plain rotation over eligible nodes, blind to memory (what most load balancers do)."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    name: str = "round_robin"
    checks_fit: bool = False
    _next: int = 0

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        names = sorted(n.name for n in eligible(snapshot, req, now, self.settings))
        if not names:
            return []
        start = self._next % len(names)
        self._next += 1
        return names[start:] + names[:start]


@dataclass
class LeastLoadedPolicy(Policy):
    """Fewest requests in flight first (running as reported plus the gateway's own)."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    name: str = "least_loaded"
    checks_fit: bool = False

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        def load(n: NodeView) -> tuple[int, str]:
            running = n.report.running + n.report.waiting if n.report is not None else 0
            return (max(running, n.overlay.inflight), n.name)

        return [n.name for n in sorted(eligible(snapshot, req, now, self.settings), key=load)]


@dataclass
class MostFreePolicy(Policy):
    """Most total free KV memory first: aware of memory, blind to fragmentation."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    name: str = "most_free"
    checks_fit: bool = False

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        def free(n: NodeView) -> tuple[int, str]:
            f = n.report.free_tokens - n.overlay.pending_tokens if n.report is not None else 0
            return (-f, n.name)

        return [n.name for n in sorted(eligible(snapshot, req, now, self.settings), key=free)]


POLICIES: dict[str, type[Policy]] = {
    "kvroute": KvroutePolicy,
    "round_robin": RoundRobinPolicy,
    "least_loaded": LeastLoadedPolicy,
    "most_free": MostFreePolicy,
}


def make_policy(name: str, settings: PolicySettings | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(settings=settings or PolicySettings())
