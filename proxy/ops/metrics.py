"""The fleet-operations metrics, read at scrape time from the gateway's ``Maintenance``.

Registered on ``GatewayMetrics.registry`` next to the per-backend fleet gauges; the names
are documented in docs/observability.md (the alert rules and the dashboard use them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.ops.advice import ACTIONS
from proxy.ops.maintenance import Maintenance


class OpsCollector(Collector):
    def __init__(self, ops: Maintenance, now: Callable[[], float]) -> None:
        self._ops = ops
        self._now = now

    def collect(self) -> Iterator[Metric]:
        ops = self._ops
        now = self._now()
        rate = GaugeMetricFamily(
            "allocation_failure_rate_at_high_free_memory",
            "Allocation failures per second over the last 60s while the fleet's aggregate free memory was above 25%",
        )
        rate.add_metric([], ops.failures.rate_at_high_free(now))
        corr = GaugeMetricFamily(
            "node_uptime_vs_fragmentation_correlation",
            "Pearson correlation of the fragmentation ratio with uptime since the last restart",
            labels=["backend"],
        )
        trend = GaugeMetricFamily(
            "kvroute_fragmentation_trend_per_hour",
            "Least-squares slope of the fragmentation ratio per hour of uptime",
            labels=["backend"],
        )
        for name, t in sorted(ops.tracker.trends().items()):
            corr.add_metric([name], t.correlation)
            trend.add_metric([name], t.slope_per_hour)
        restarts = CounterMetricFamily(
            "kvroute_restarts",
            "Node restarts this gateway performed or observed",
            labels=["backend", "reason"],
        )
        for (backend, reason), n in sorted(ops.restarts.items()):
            restarts.add_metric([backend, reason], float(n))
        advice = GaugeMetricFamily(
            "kvroute_scaling_advice",
            "1 for the current advice (none, restart, scale_up), 0 for the others",
            labels=["action"],
        )
        current = ops.advice.action if ops.advice is not None else "none"
        for action in ACTIONS:
            advice.add_metric([action], 1.0 if action == current else 0.0)
        demand = GaugeMetricFamily(
            "kvroute_effective_demand_tokens",
            "KV demand in tokens excluding fragmentation failures: in use plus what no node could hold",
        )
        if ops.advice is not None:
            demand.add_metric([], float(ops.advice.fleet.get("effective_demand_tokens", 0.0)))
        yield from (rate, corr, trend, restarts, advice, demand)
