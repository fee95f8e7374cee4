"""Prometheus view of the collector's own work: its scrapes of each backend, computed at scrape time.

Why: a backend the collector cannot read is marked down, and routing stops sending it work.
Until now the reason was in the log only; ``kvroute_backend_up`` said *that* it was down,
not whether its port refused, its scrapes timed out or its metrics changed shape after an
upgrade. These series say which, and how long scrapes take (a slow ``/metrics`` ages every
report routing reads).

Only the replica holding the collector lock scrapes (``proxy.backends.collector``), so the
per-backend series come from that replica; the others export none of them, and
``kvroute_collector_leader`` says which one it is. Names are documented in
docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PrometheusCollector

Status = Callable[[], dict[str, Any]]


class CollectorMetrics(PrometheusCollector):
    """Series of ``Collector.status()``: per backend and for the collector's rounds."""

    def __init__(self, status: Status) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        st = self._status()
        scrapes = CounterMetricFamily(
            "kvroute_scrapes",
            "Scrapes of each backend's metrics by this replica, by how they ended",
            labels=["backend", "result"],
        )
        duration = GaugeMetricFamily(
            "kvroute_scrape_duration_seconds",
            "How long the last scrape of the backend took, failed or not",
            labels=["backend"],
        )
        failing = GaugeMetricFamily(
            "kvroute_scrape_consecutive_failures",
            "Failed scrapes in a row (collector.fall of them mark the backend down)",
            labels=["backend"],
        )
        last_ok = GaugeMetricFamily(
            "kvroute_scrape_last_success_timestamp_seconds",
            "Unix time of the backend's last good scrape (0: none yet)",
            labels=["backend"],
        )
        for name, b in sorted(st["backends"].items()):
            for result, n in sorted(b["results"].items()):
                scrapes.add_metric([name, result], float(n))
            if b["latency_s"] is not None:
                duration.add_metric([name], float(b["latency_s"]))
            failing.add_metric([name], float(b["consecutive_failures"]))
            last_ok.add_metric([name], float(b["last_success_at"]))
        leader = GaugeMetricFamily(
            "kvroute_collector_leader",
            "1 while this replica holds the collector lock and scrapes the backends",
        )
        leader.add_metric([], 1.0 if st["leader"] else 0.0)
        rounds = CounterMetricFamily(
            "kvroute_collector_rounds",
            "Collector rounds: scraped by this replica, or skipped (another holds the lock)",
            labels=["result"],
        )
        rounds.add_metric(["scraped"], float(st["rounds_total"]))
        rounds.add_metric(["skipped"], float(st["rounds_skipped_total"]))
        errors = CounterMetricFamily(
            "kvroute_collector_errors",
            "Collector failures outside a backend's scrape: the store (lock, report writes), "
            "a round, an on-report hook",
            labels=["kind"],
        )
        errors.add_metric(["store"], float(st["store_errors_total"]))
        errors.add_metric(["round"], float(st["round_errors_total"]))
        errors.add_metric(["hook"], float(st["hook_errors_total"]))
        yield from (scrapes, duration, failing, last_ok, leader, rounds, errors)
