"""The gateway's book of prefills run during a decode hold (``proxy.core.early_prefill``).

One per gateway: it bounds what each prefill server holds for requests still waiting for a
decode server, and shows it (``kvroute_prefill_held_for_waiting_tokens``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from proxy.core.early_prefill import EarlyPrefills
from proxy.core.fleet import FleetSnapshot


class EarlyPrefillBook:
    """Blocks held on prefill servers for held requests: counted, capped, shown."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.holds = EarlyPrefills()
        self.gauge = Gauge(
            "kvroute_prefill_held_for_waiting_tokens",
            "Prompt tokens a prefill server holds for requests this gateway holds until a "
            "decode server fits (step 1 ran during the hold)",
            ["backend"],
            registry=registry,
        )

    def full(
        self, servers: frozenset[str], snap: FleetSnapshot, prompt_tokens: int, fraction: float
    ) -> frozenset[str]:
        """Prefill servers at their cap for this prompt (no report: unknown, so full)."""
        capacity = {
            n.name: n.report.capacity_tokens for n in snap.nodes if n.report is not None and n.up
        }
        return self.holds.full(servers, capacity, prompt_tokens, fraction)

    def add(self, backend: str, key: str, tokens: int) -> None:
        self.holds.add(backend, key, tokens)
        self.gauge.labels(backend).set(self.holds.tokens(backend))

    def move(self, key: str, backend: str) -> None:
        for name in self.holds.move(key, backend):
            self.gauge.labels(name).set(self.holds.tokens(name))

    def release(self, key: str) -> None:
        for backend in self.holds.release(key):
            self.gauge.labels(backend).set(self.holds.tokens(backend))
