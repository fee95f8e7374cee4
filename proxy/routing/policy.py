"""Routing policy, the contract: classify a request, the ``Policy`` that ranks backends for it.

Pure and deterministic: a fleet snapshot, a request and the time go in, an ordered list
of backend names comes out. The gateway and the offline fleet simulator run this same
code, so what the simulator shows is what the gateway does.

Each policy lives in its own module of ``proxy.routing`` (the Rust routers' ``policies/``
shape) and is found by name in ``proxy.routing.registry``: ``kvroute`` is the
fragmentation-aware policy; ``round_robin``, ``least_loaded`` and ``most_free`` are what peer
routers do, kept selectable so operators can A/B them.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

from proxy.config import CollectorConfig, RoutingConfig
from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.core.freshness import judged_at
from proxy.routing.affinity import AffinitySettings

# Re-exported: the one per-node test of why nothing fits lives in its own module.
from proxy.routing.nothing_fits import nothing_fits_reason as nothing_fits_reason

if TYPE_CHECKING:
    from proxy.routing.node_cost import NodeCost

RequestClass = Literal["short", "long"]


def classify(demand_tokens: int, long_threshold_tokens: int) -> RequestClass:
    """Long at or above the threshold. Demand (prompt + max new tokens) is what the KV cache holds."""
    return "long" if demand_tokens >= long_threshold_tokens else "short"


@dataclass(frozen=True, slots=True)
class RouteRequest:
    demand: int
    cls: RequestClass
    exclude: frozenset[str] = frozenset()
    # Prompt tokens each node probably holds in its prefix cache (``proxy.core.prefix``).
    cached: Mapping[str, int] = field(default_factory=lambda: _NOTHING_CACHED)
    # The node this request's session went to last (``x-session-id`` / the ``user`` field).
    session_node: str | None = None
    # Given for a prompt worth caching: tokens the prefix index holds per node (spreads new
    # prefixes over the fleet's caches, ``proxy.routing.affinity``).
    indexed: Mapping[str, int] | None = None
    # Given for a prompt worth caching on queueing servers: each node's prefill backlog and
    # this prompt's uncached tokens there (``proxy.routing.expected_ttft``), and the seconds
    # of expected TTFT within which the affinity order stands.
    ttft: Mapping[str, NodeCost] | None = None
    ttft_slack_s: float = 0.0
    # The model's TTFT predictions miss (``proxy.routing.prediction_check``): queueing nodes
    # rank by least outstanding requests, then tokens, as a blind router does (fit kept).
    blind: bool = False


_NOTHING_CACHED: Mapping[str, int] = MappingProxyType({})


# The config model's defaults, not retyped here.
_ROUTING, _COLLECTOR = RoutingConfig(), CollectorConfig()


@dataclass(frozen=True, slots=True)
class PolicySettings:
    safety_margin: float = _ROUTING.safety_margin
    stale_after_s: float = _COLLECTOR.stale_after_s
    long_threshold_tokens: int = _ROUTING.long_threshold_tokens
    affinity: AffinitySettings = field(default_factory=AffinitySettings)


def eligible(
    snapshot: FleetSnapshot, req: RouteRequest, now: float, settings: PolicySettings
) -> list[NodeView]:
    """Nodes a request may go to at all: up, not draining, not cooling down, not already failed.

    A node whose report is stale is excluded only when it has a report: a backend with no
    report at all (e.g. a vLLM server whose metrics are not scraped) stays routable as "unknown".
    Staleness is judged against the newest report in the fleet (``proxy.core.freshness``):
    reports that all arrive late because this gateway's loop is late stale no node.
    """
    out: list[NodeView] = []
    exclude = req.exclude
    stale_after = settings.stale_after_s
    judged = judged_at(snapshot, now, stale_after)
    for n in snapshot.nodes:
        ov = n.overlay
        if not n.up or ov.draining or now < ov.cooldown_until or (exclude and n.name in exclude):
            continue
        r = n.report
        if r is not None and judged - r.reported_at > stale_after:  # NodeView.stale, inlined
            continue
        out.append(n)
    return out


class Policy(abc.ABC):
    """Ranks backends for one request. `checks_fit` says whether it reads memory state at all."""

    name: str = "abstract"
    checks_fit: bool = True

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()

    @abc.abstractmethod
    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        """Backend names, best first. Empty when nothing can take the request now."""
