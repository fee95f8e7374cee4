"""Round robin: what most load balancers do, blind to memory (a baseline to A/B against)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.fleet import FleetSnapshot
from proxy.routing.policy import Policy, PolicySettings, RouteRequest, eligible


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
