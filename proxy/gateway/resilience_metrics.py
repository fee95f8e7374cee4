"""Scrape-time gauges for the request path's fault handling: breaker, retry budget, releases."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.retry_budget import RetryBudget
from proxy.state.breaker import CircuitBreaker


class ResilienceCollector(Collector):
    def __init__(
        self, breaker: CircuitBreaker, budget: RetryBudget, ledger: ReservationLedger
    ) -> None:
        self._breaker = breaker
        self._budget = budget
        self._ledger = ledger

    def collect(self) -> Iterator[Metric]:
        b = self._breaker
        open_ = GaugeMetricFamily(
            "kvroute_store_circuit_open", "1 while the store circuit breaker is open or half-open"
        )
        open_.add_metric([], 0.0 if b.state == "closed" else 1.0)
        opened = CounterMetricFamily(
            "kvroute_store_circuit_opened", "Times the store circuit breaker opened"
        )
        opened.add_metric([], float(b.opened_total))
        retries = GaugeMetricFamily(
            "kvroute_retries_in_flight", "Retries of failed attempts in flight (retry budget)"
        )
        retries.add_metric([], float(self._budget.in_flight))
        exhausted = CounterMetricFamily(
            "kvroute_retry_budget_exhausted", "Retries refused because the retry budget was spent"
        )
        exhausted.add_metric([], float(self._budget.exhausted_total))
        held = GaugeMetricFamily(
            "kvroute_reservations_held", "Reservations this gateway holds for requests in flight"
        )
        held.add_metric([], float(len(self._ledger.held)))
        pending = GaugeMetricFamily(
            "kvroute_reservation_releases_pending", "Releases that failed and are being retried"
        )
        pending.add_metric([], float(len(self._ledger.pending)))
        yield from (open_, opened, retries, exhausted, held, pending)
