"""Least loaded: fewest requests in flight first, blind to memory (a baseline to A/B against)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.routing.policy import Policy, PolicySettings, RouteRequest, eligible


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
