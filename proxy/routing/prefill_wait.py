"""Step 1 of a disaggregated request: the prefill server expected to finish the prompt soonest.

A prefill server holds a prompt's KV only until the decode server pulls it, so its memory
is not what runs out: its cost is time. The wait is its backlog of uncomputed prompt tokens
over its prefill rate (``proxy.routing.queueing.expected_wait_s``: learned rates where the
server exports them, ``proxy.routing.prefill_rate``), and this prompt's own tokens count
less whatever that server already caches of it (``RouteRequest.cached``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.routing.policy import Policy, PolicySettings, RouteRequest, eligible
from proxy.routing.queueing import Rates, expected_wait_s


@dataclass
class PrefillWaitPolicy(Policy):
    """Shortest expected prefill wait first; never refuses for memory (the server queues)."""

    settings: PolicySettings = field(default_factory=PolicySettings)
    rates: Mapping[str, Rates] = field(default_factory=dict)
    name: str = "prefill_wait"
    checks_fit: bool = False

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        prompt = req.demand

        def wait(n: NodeView) -> tuple[float, str]:
            uncached = max(0, prompt - req.cached.get(n.name, 0))
            rate = self.rates.get(n.name, Rates())
            return (expected_wait_s(n, uncached, prompt, rate), n.name)

        return [n.name for n in sorted(eligible(snapshot, req, now, self.settings), key=wait)]
