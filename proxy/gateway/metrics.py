"""The gateway's Prometheus metrics (names documented in docs/observability.md).

Counters and histograms are updated on the request path; per-backend gauges are computed
at scrape time from the latest fleet snapshot by a custom collector, so they cost nothing
per request and can never go stale relative to what the router used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView
from proxy.gateway.loop_metrics import unlocked
from proxy.gateway.sizing_metrics import SizingCollector

M = TypeVar("M", bound=MetricWrapperBase)

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# Per-backend gauges read off each node's last report: (name, help, value at ``now``).
_REPORT_GAUGES: tuple[tuple[str, str, Callable[[MemoryReport, float], float]], ...] = (
    (
        "largest_contiguous_free_block_ratio",
        "Largest contiguous free KV block / total free KV memory",
        lambda r, now: r.largest_block_ratio,
    ),
    (
        "kvroute_fragmentation_ratio",
        "1 - largest free block / total free",
        lambda r, now: r.fragmentation,
    ),
    ("kvroute_backend_free_fraction", "Free KV memory / capacity", lambda r, now: r.free_fraction),
    (
        "kvroute_backend_free_tokens",
        "Free KV memory in tokens",
        lambda r, now: float(r.free_tokens),
    ),
    (
        "kvroute_backend_largest_free_block_tokens",
        "Largest contiguous free block in tokens",
        lambda r, now: float(r.largest_free_block_tokens),
    ),
    (
        "kvroute_backend_capacity_tokens",
        "KV capacity in tokens",
        lambda r, now: float(r.capacity_tokens),
    ),
    (
        "kvroute_backend_uptime_seconds",
        "Seconds since the backend's last restart",
        lambda r, now: r.uptime(now),
    ),
)
# Per-backend gauges of the gateway's own view of each node, report or not.
_NODE_GAUGES: tuple[tuple[str, str, Callable[[NodeView], float]], ...] = (
    (
        "kvroute_backend_up",
        "1 if the backend is reachable and reporting",
        lambda n: 1.0 if n.up else 0.0,
    ),
    (
        "kvroute_backend_draining",
        "1 while the backend is drained",
        lambda n: 1.0 if n.overlay.draining else 0.0,
    ),
    (
        "kvroute_reserved_tokens",
        "Tokens reserved by in-flight requests",
        lambda n: float(n.overlay.reserved_tokens),
    ),
    (
        "kvroute_inflight_requests",
        "Requests in flight through the gateway",
        lambda n: float(n.overlay.inflight),
    ),
)
_PRESSURE_REASONS = ("queue", "slots", "preemption", "asleep")


class FleetCollector(Collector):
    """Per-backend gauges derived from the snapshot the router last used."""

    def __init__(
        self, snapshot: Callable[[], FleetSnapshot | None], now: Callable[[], float]
    ) -> None:
        self._snapshot = snapshot
        self._now = now

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        now = self._now()
        labels = ["backend", "pool"]
        by_report = [(GaugeMetricFamily(n, h, labels=labels), f) for n, h, f in _REPORT_GAUGES]
        by_node = [(GaugeMetricFamily(n, h, labels=labels), f) for n, h, f in _NODE_GAUGES]
        pressure = GaugeMetricFamily(
            "kvroute_backend_pressure",
            "1 while a queueing backend is full for new work: queue, slots, preemption or asleep",
            labels=["backend", "reason"],
        )
        for node in snap.nodes if snap is not None else ():
            values = [node.name, node.pool]
            for family, of_node in by_node:
                family.add_metric(values, of_node(node))
            for reason in _PRESSURE_REASONS:
                on = 1.0 if node.overlay.pressure == reason else 0.0
                pressure.add_metric([node.name, reason], on)
            if node.report is not None:
                for family, of_report in by_report:
                    family.add_metric(values, of_report(node.report, now))
        yield from (family for family, _ in by_report)
        yield from (family for family, _ in by_node)
        yield pressure


class GatewayMetrics:
    """All request-path metrics in one registry of the gateway's own (several apps per process in tests)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        # Children of labelled metrics by (metric, label values): see ``labelled``.
        self._children: dict[tuple[int, tuple[str, ...]], MetricWrapperBase] = {}
        # Chunk-cache and sizing counters, read at scrape time (proxy.gateway.sizing_metrics).
        r.register(SizingCollector())
        self._count_outcomes(r)
        self._time_requests(r)
        self._watch_the_gateway(r)

    def _count_outcomes(self, r: CollectorRegistry) -> None:
        """How requests and their attempts ended, and why some were refused or retried."""
        self.requests = Counter(
            "kvroute_requests",
            "Requests by class, final backend and outcome",
            ["class", "backend", "outcome"],
            registry=r,
        )
        self.attempts = Counter(
            "kvroute_attempts",
            "Upstream attempts by backend and result",
            ["backend", "result"],
            registry=r,
        )
        self.allocation_failures = Counter(
            "kvroute_allocation_failures",
            "KV allocation failures (at a backend, or nothing fits at the gateway) by cause",
            ["cause", "backend"],
            registry=r,
        )
        self.failures_high_free = Counter(
            "kvroute_allocation_failures_at_high_free_memory",
            "Allocation failures while the fleet's aggregate free memory was above 25%",
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries", "Attempts after the first, by reason", ["reason"], registry=r
        )
        self.rejected = Counter(
            "kvroute_rejected", "Requests refused before routing, by reason", ["reason"], registry=r
        )

    def _time_requests(self, r: CollectorRegistry) -> None:
        """Where a request's time goes: the admission queue, the decision, the whole request."""
        self.queue_depth = Gauge(
            "kvroute_queue_depth", "Requests waiting for a node with a big enough block", registry=r
        )
        self.queue_wait = Histogram(
            "kvroute_queue_wait_seconds",
            "Time spent waiting in the admission queue",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        # Observed once per request, on the loop's thread (proxy.gateway.loop_metrics).
        self.decision = unlocked(
            Histogram(
                "kvroute_routing_decision_seconds",
                "Time to size, classify and rank a request (incl. tokenization)",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.duration = Histogram(
            "kvroute_request_duration_seconds",
            "End-to-end request time through the gateway",
            ["class"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )

    def _watch_the_gateway(self, r: CollectorRegistry) -> None:
        """The gateway's own state: the store, requests in flight, two-step requests."""
        self.store_degraded = Gauge(
            "kvroute_store_degraded",
            "1 while the state store is unreachable and routing runs on a snapshot",
            registry=r,
        )
        self.store_errors = Counter(
            "kvroute_store_errors", "State store calls that failed or timed out", ["op"], registry=r
        )
        self.active = Gauge(
            "kvroute_active_requests", "Requests being handled by this gateway", registry=r
        )
        self.two_step = Counter(
            "kvroute_two_step",
            "Steps of disaggregated requests (docs/disaggregation.md) by step and result",
            ["step", "result"],
            registry=r,
        )

    def labelled(self, metric: M, *values: str) -> M:
        """``metric.labels(*values)``, looked up once per label set: prometheus_client
        checks and locks on every ``labels()`` call, three times per request. The child is
        updated without a lock: only on the loop's thread (proxy.gateway.loop_metrics)."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = unlocked(metric.labels(*values))
        return child  # type: ignore[return-value]

    def attach_fleet(
        self, snapshot: Callable[[], FleetSnapshot | None], now: Callable[[], float]
    ) -> None:
        self.registry.register(FleetCollector(snapshot, now))
