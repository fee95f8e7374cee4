"""Most free: most free KV memory first, blind to fragmentation (a baseline to A/B against)."""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.routing.policy import Policy, PolicySettings, RouteRequest, eligible


@dataclass
class MostFreePolicy(Policy):
    """Most total free KV memory first: aware of memory, blind to fragmentation."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    name: str = "most_free"
    checks_fit: bool = False

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        def free(n: NodeView) -> tuple[int, str]:
            return (-n.usable_free(), n.name)

        return [n.name for n in sorted(eligible(snapshot, req, now, self.settings), key=free)]
