"""The gateway's side of the self-checking model (``proxy.routing.prediction_check``).

At placement on a queueing backend, a streamed request records the TTFT the model predicts
there (``expected_wait_s`` at the rates in use, on the view it was ranked on); at its first
event the observed TTFT (from placement) is checked against it. The metrics show both per
backend, the misses, and whether the ranking runs blind; ``GET /fleet`` shows the record
(``ttft_model``).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy.core.fleet import NodeView
from proxy.gateway.context import RequestContext
from proxy.routing.prediction_check import CheckSettings, PredictionCheck
from proxy.routing.queueing import Rates, expected_wait_s

# TTFT buckets (seconds): vLLM's histogram's range, from tens of milliseconds to minutes.
_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class TtftCheck:
    """Predicted against observed TTFT per backend; the ranking's fallback switch."""

    def __init__(self, registry: CollectorRegistry, settings: CheckSettings | None = None) -> None:
        self.check = PredictionCheck(settings or CheckSettings())
        self.predicted = Histogram(
            "kvroute_ttft_predicted_seconds",
            "TTFT the model predicted at placement on a queueing backend (streams)",
            ["backend"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.observed = Histogram(
            "kvroute_ttft_observed_seconds",
            "TTFT observed from placement to the first event, for the same streams",
            ["backend"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.misses = Counter(
            "kvroute_ttft_prediction_misses",
            "Predictions off the observed TTFT by more than the stated margin",
            ["backend"],
            registry=registry,
        )
        blind = Gauge(
            "kvroute_ranking_blind",
            "1 while predictions miss and queueing nodes rank by least outstanding requests",
            registry=registry,
        )
        blind.set_function(lambda: 1.0 if self.check.blind else 0.0)

    @property
    def blind(self) -> bool:
        return self.check.blind

    def hold_bound_s(self, backend: str, predicted_s: float) -> float:
        """How long a hold for ``backend`` may last before joining its queue pays better.

        Ski rental against the queue: the predicted wait there, but never more than the
        median TTFT its recent streams really waited once sent (a model that overpredicts
        the queue held requests for many times what the queue would have cost: issue 53).
        """
        observed = self.check.observed_median(backend)
        return predicted_s if observed is None else min(predicted_s, observed)

    def predict(self, ctx: RequestContext, node: NodeView, rates: Rates) -> None:
        """Record the prediction for a stream placed on a queueing ``node``."""
        report = node.report
        if report is None or not report.queueing or not ctx.parsed.stream:
            ctx.predicted_ttft = None
            return
        wait = expected_wait_s(node, ctx.prompt_tokens, ctx.demand, rates)
        ctx.predicted_ttft = (node.name, wait, asyncio.get_running_loop().time())

    def first_event(self, ctx: RequestContext, backend: str) -> None:
        """The stream's first event arrived: check the prediction made for it (once)."""
        now = ctx.first_event_at = asyncio.get_running_loop().time()
        recorded = ctx.predicted_ttft
        if recorded is None or recorded[0] != backend:
            return
        ctx.predicted_ttft = None
        _, predicted_s, placed_at = recorded
        observed_s = now - placed_at
        self.predicted.labels(backend).observe(predicted_s)
        self.observed.labels(backend).observe(observed_s)
        if self.check.observe(backend, predicted_s, observed_s):
            self.misses.labels(backend).inc()
