"""The metrics of stream continuation (docs/observability.md): breaks and what became of them."""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter

# How a stream broke after its first byte (kvroute_stream_breaks_total{cause}).
BreakCause = Literal["reset", "stall", "error_event", "ended_early", "total_timeout"]
# What the gateway did about it (kvroute_stream_breaks_total{action}).
BreakAction = Literal["continued", "not_continuable", "limit_reached", "off", "complete"]
# Why no backend took a continuation.
Unplaced = Literal["no_backend", "budget_exhausted", "refused"]
# How one continuation ended (kvroute_continuations_total{outcome}).
ContinuationOutcome = Literal["completed", "broke_again", "client_left"] | Unplaced


class ContinuationMetrics:
    """Counters in the gateway's registry; one instance per gateway."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.breaks = Counter(
            "kvroute_stream_breaks",
            "Streams broken after their first byte, by cause and what the gateway did",
            ["cause", "action"],
            registry=registry,
        )
        self.continuations = Counter(
            "kvroute_continuations",
            "Continuations of broken streams on another backend, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.added = Counter(
            "kvroute_continuation_tokens",
            "Tokens the client had received before its stream was continued (re-read as prompt)",
            registry=registry,
        )

    def broke(self, cause: BreakCause, action: BreakAction) -> None:
        self.breaks.labels(cause, action).inc()

    def ended(self, outcome: ContinuationOutcome) -> None:
        self.continuations.labels(outcome).inc()
