"""Late binding for queueing backends: hold while it pays, then join the shortest queue.

A request that fits nowhere now waits in the gateway's admission queue. For fail-fast
backends (the kvroute contract) the hold is bounded by ``queue.max_wait_s`` and ends in 503.
For queueing backends (vLLM, SGLang, TGI: they queue instead of failing) a backend's queue is
a valid place to wait, never a reason for a 503:

* the best backend (``proxy.routing.queueing``: shortest expected wait) has the KV room and
  only its queue or slots are full: join it at once; a FIFO queue there starts the request
  as soon as the gateway could have (measured: holding behind the pressure signal made
  short-request TTFT worse, docs/benchmarks.md section 6);
* it is short of KV (sending now risks preemption): hold, but only as long as its expected
  wait (ski rental: the hold never costs more than twice the better of the two choices) and
  at most ``queue.max_wait_s``; then join it, with an unchecked reservation;
* the model's TTFT predictions miss (``proxy.routing.prediction_check``): the ranking turns
  blind, the fit (and so this hold) is kept: on vLLM v1's scheduler model a hold dropped
  with the model let a preemption storm start (1,346 preemptions in 12 s against 0-105).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot
from proxy.gateway.context import RequestContext
from proxy.gateway.held_room import kept_for
from proxy.gateway.memory_pressure import MemoryPressure
from proxy.gateway.ttft_check import TtftCheck
from proxy.routing.policy import PolicySettings, RouteRequest, eligible
from proxy.routing.pool_sizing import PoolSizing
from proxy.routing.prefill_rate import PrefillRates
from proxy.routing.queueing import (
    DEFAULT_DECODE_TOKENS_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    QueueingSettings,
    Rates,
    by_line_length,
    is_queueing,
    rank_by_wait,
)


def settings_from(cfg: Config) -> QueueingSettings:
    rates = {
        b.name: Rates(
            b.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S,
            b.decode_tokens_per_s or DEFAULT_DECODE_TOKENS_PER_S,
        )
        for b in cfg.backends
    }
    return QueueingSettings(cfg.routing.spill_margin_s, rates)


class BackendQueues:
    """The gateway's side of queueing backends: settings and the hand-over counter."""

    def __init__(self, cfg: Config, registry: CollectorRegistry) -> None:
        self.settings = settings_from(cfg)
        self.policy_settings = PolicySettings(
            safety_margin=cfg.routing.safety_margin,
            stale_after_s=cfg.collector.stale_after_s,
            long_threshold_tokens=cfg.routing.long_threshold_tokens,
        )
        self.handed = Counter(
            "kvroute_queued_at_backend_total",
            "Requests that fit nowhere now, sent to the queueing backend expected to start them soonest",
            ["backend", "why"],
            registry=registry,
        )
        # Pool sizing from the pools' expected waits (``GET /fleet/advice``: ``pools``).
        self.sizing = PoolSizing()
        self.long_threshold_tokens = cfg.routing.long_threshold_tokens
        # Prefill rates learned from each backend's own metrics; the configured ones otherwise.
        self.prefill = PrefillRates()
        self.rate_in_use = Gauge(
            "kvroute_backend_prefill_tokens_per_second",
            "Prefill rate behind a queueing backend's expected wait (learned from its metrics, "
            "else configured), per engine",
            ["backend"],
            registry=registry,
        )
        self._shown: dict[str, float] = {}
        # Which backends' rates the config sets (the others run on the defaults until learned).
        self._configured = {
            b.name: (bool(b.prefill_tokens_per_s), bool(b.decode_tokens_per_s))
            for b in cfg.backends
        }

    def current(self, snap: FleetSnapshot) -> QueueingSettings:
        """The settings with each backend's learned prefill rate where it has one."""
        configured = self.settings.rates
        rates = dict(configured)
        for n in snap.nodes:
            if n.report is None or not n.report.queueing:
                continue
            self.prefill.observe(n.name, n.report)
            base = configured.get(n.name, Rates())
            learned = self.prefill.rate(n.name)
            rate = Rates(learned, base.decode_tokens_per_s) if learned is not None else base
            rates[n.name] = rate
            if self._shown.get(n.name) != rate.prefill_tokens_per_s:
                self._shown[n.name] = rate.prefill_tokens_per_s
                self.rate_in_use.labels(n.name).set(rate.prefill_tokens_per_s)
        return QueueingSettings(self.settings.spill_margin_s, rates)

    def rates_for(self, name: str) -> Rates:
        """The rates the model uses for ``name`` now: its learned prefill rate where known."""
        base = self.settings.rates.get(name, Rates())
        learned = self.prefill.rate(name)
        return Rates(learned, base.decode_tokens_per_s) if learned is not None else base

    def rates_json(
        self, snap: FleetSnapshot, decode: Callable[[str], float | None]
    ) -> dict[str, dict[str, object]]:
        """``/fleet``'s ``rates``: each queueing backend's prefill and decode rates in use, and
        where each comes from (``learned``: the server's prefill counters; ``streams``: the
        decode rate its relayed streams show; else ``configured`` or ``default``)."""
        out: dict[str, dict[str, object]] = {}
        for name in sorted(n.name for n in snap.nodes if n.report and n.report.queueing):
            rates = self.rates_for(name)
            prefill_set, decode_set = self._configured.get(name, (False, False))
            observed = decode(name)
            out[name] = {
                "prefill_tokens_per_s": round(rates.prefill_tokens_per_s, 1),
                "prefill_source": "learned"
                if self.prefill.rate(name) is not None
                else ("configured" if prefill_set else "default"),
                "decode_tokens_per_s": round(
                    observed if observed is not None else rates.decode_tokens_per_s, 1
                ),
                "decode_source": "streams"
                if observed is not None
                else ("configured" if decode_set else "default"),
            }
        return out

    def pool_advice(self, snap: FleetSnapshot, now: float) -> dict[str, object]:
        verdict = self.sizing.observe(
            snap,
            now,
            self.current(snap),
            self.long_threshold_tokens,
            self.policy_settings.stale_after_s,
        )
        return self.sizing.to_json(verdict)

    def ranked(
        self, ctx: RequestContext, snap: FleetSnapshot, avoid: frozenset[str], now: float
    ) -> list[tuple[str, float]]:
        """Queueing backends the request may go to, by expected wait (empty: none queue)."""
        req = RouteRequest(ctx.demand, ctx.cls, avoid)
        # ``snap`` carries this replica's own reservations (``Gateway.local``): a burst spreads.
        nodes = [n for n in eligible(snap, req, now, self.policy_settings) if is_queueing(n)]
        settings = self.current(snap)
        return rank_by_wait(nodes, ctx.prompt_tokens, ctx.demand, ctx.cls, settings)

    def deferring(
        self, ctx: RequestContext, snap: FleetSnapshot, avoid: frozenset[str], now: float
    ) -> list[str]:
        """Servers that queue the request rather than refuse it for room, fewest ahead first.

        llama.cpp's partitioned slots (``NodeView.queued_block``): the policy sends a request
        there only as the next in line, and holds it otherwise; a hold that ran its limit
        joins the shortest such line rather than be answered 503, as a hold for a queueing
        backend joins its queue.
        """
        req = RouteRequest(ctx.demand, ctx.cls, avoid)
        margin = self.policy_settings.safety_margin
        nodes = [
            n
            for n in eligible(snap, req, now, self.policy_settings)
            if not is_queueing(n) and n.queued_block() and n.fits(ctx.demand, now, margin)
        ]
        return [n.name for n in by_line_length(nodes)]


class QueueingPorts(Protocol):
    """What the queueing-backend rules use: the queues, the KV projection, the clock."""

    queues: BackendQueues
    pressure: MemoryPressure
    ttft_check: TtftCheck
    clock: Callable[[], float]


def hold_over(
    gw: QueueingPorts, ctx: RequestContext, snap: FleetSnapshot, avoid: frozenset[str]
) -> bool:
    """Should the request stop holding at the gateway and join a backend's queue now?

    At once when the best backend has the KV room and only its queue or slots are full: the
    gateway learns nothing a FIFO queue there would not act on sooner (a hold would only add
    a report interval). Otherwise once the hold has lasted as long as that backend's expected
    wait (it is short of KV: holding avoids preemption while it lasts).
    """
    if not gw.pressure.order.may_place(ctx.reservation_id):
        # An older held request reached its overtake limit and has not named its node yet.
        return False
    # The nodes kept for older held requests at their overtake limit (``held_room``).
    ranked = gw.queues.ranked(ctx, snap, avoid | kept_for(gw.pressure, ctx), gw.clock())
    if not ranked:
        return False
    best = snap.by_name()[ranked[0][0]]
    if best.usable_block() >= ctx.demand:
        return True
    if ctx.two_step is not None:
        # A decode server short of KV preempts what it holds: a disaggregated fleet's request
        # holds here until one fits, up to ``queue.max_wait_s`` (docs/disaggregation.md).
        return False
    held = time.monotonic() - ctx.hold_started if ctx.hold_started is not None else 0.0
    rate = decode_rate(gw, best.name)
    # Ski rental against the queue: the predicted wait, bounded by what its streams waited.
    bound = gw.ttft_check.hold_bound_s(best.name, ranked[0][1])
    return gw.pressure.hand_over(ctx, best, held, bound, rate)


def decode_rate(gw: QueueingPorts, backend: str) -> float:
    """Tokens per second per request on ``backend``: its streams', else the configured rate."""
    learned = gw.pressure.decode.rate(backend)
    if learned is not None:
        return learned
    return gw.queues.settings.rates.get(backend, Rates()).decode_tokens_per_s


def predict_ttft(gw: QueueingPorts, ctx: RequestContext, view: FleetSnapshot, backend: str) -> None:
    """Record the TTFT the model predicts for this stream on ``backend`` (queueing nodes only),
    checked at its first event (``proxy.gateway.ttft_check``)."""
    if not ctx.parsed.stream:
        # Only a stream's first event is observed: nothing to check, nothing to build.
        return
    node = next((n for n in view.nodes if n.name == backend), None)
    if node is not None and node.report is not None and node.report.queueing:
        rates = gw.queues.rates_for(backend)
        rates = Rates(rates.prefill_tokens_per_s, decode_rate(gw, backend))
        gw.ttft_check.predict(ctx, node, rates)
