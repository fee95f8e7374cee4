"""Late binding for queueing backends: hold while it pays, then join the shortest queue.

A request that fits nowhere now waits in the gateway's admission queue. For fail-fast
backends (the kvroute contract) the hold is bounded by ``queue.max_wait_s`` and ends in 503.
For queueing backends (vLLM, SGLang, TGI: they queue instead of failing) a backend's queue is
a valid place to wait, so the hold ends as soon as it has lasted as long as the best
backend's expected wait (ski rental: holding never costs more than twice the better of the
two choices), or at the client's own deadline, and the request then goes to the backend
where it is expected to start soonest (``proxy.routing.queueing``) with an unchecked
reservation, never a 503 because memory looks short.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.gateway.context import RequestContext
from proxy.routing.policy import PolicySettings, RouteRequest, eligible
from proxy.routing.queueing import (
    DEFAULT_DECODE_TOKENS_PER_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    QueueingSettings,
    Rates,
    is_queueing,
    rank_by_wait,
)
from proxy.state.base import StoreUnavailable

if TYPE_CHECKING:
    from proxy.gateway.walk import Gateway


# Hand-overs older than this are in any snapshot the gateway still ranks on.
RECENT_S = 5.0


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

        # (when, backend, demand) of this replica's recent hand-overs: see ``_with_own``.
        self._recent: deque[tuple[float, str, int]] = deque()

    def ranked(
        self, ctx: RequestContext, snap: FleetSnapshot, avoid: frozenset[str], now: float
    ) -> list[tuple[str, float]]:
        """Queueing backends the request may go to, by expected wait (empty: none queue)."""
        req = RouteRequest(ctx.demand, ctx.cls, avoid)
        nodes = [
            self._with_own(n, snap.taken_at)
            for n in eligible(snap, req, now, self.policy_settings)
            if is_queueing(n)
        ]
        return rank_by_wait(nodes, ctx.prompt_tokens, ctx.demand, ctx.cls, self.settings)

    def handed_over(self, backend: str, demand: int, now: float, why: str) -> None:
        self.handed.labels(backend, why).inc()
        self._recent.append((now, backend, demand))
        while self._recent and now - self._recent[0][0] > RECENT_S:
            self._recent.popleft()

    def _with_own(self, n: NodeView, taken_at: float) -> NodeView:
        """Never herd: hand-overs newer than the snapshot count at once in this replica's view
        (requests ranked on one snapshot would otherwise all pick the same backend)."""
        newer = [d for at, name, d in self._recent if name == n.name and at >= taken_at]
        if not newer:
            return n
        ov = dataclasses.replace(
            n.overlay,
            inflight=n.overlay.inflight + len(newer),
            reserved_tokens=n.overlay.reserved_tokens + sum(newer),
        )
        return dataclasses.replace(n, overlay=ov)


def hold_over(gw: Gateway, ctx: RequestContext, snap: FleetSnapshot, avoid: frozenset[str]) -> bool:
    """Has holding at the gateway lasted as long as joining the best backend's queue would?"""
    ranked = gw.queues.ranked(ctx, snap, avoid, gw.clock())
    if not ranked or ctx.hold_started is None:
        return False
    return time.monotonic() - ctx.hold_started >= ranked[0][1]


async def join_queue(
    gw: Gateway, ctx: RequestContext, avoid: frozenset[str], why: str
) -> str | None:
    """Reserve (unchecked) on the queueing backend with the shortest expected wait."""
    ctx.snap = await gw.fleet.snapshot(force=True)
    now = gw.clock()
    for name, _wait in gw.queues.ranked(ctx, ctx.snap, avoid, now):
        reserve = functools.partial(
            gw.store.reserve,
            name,
            ctx.reservation_id,
            ctx.demand,
            now,
            gw.cfg.store.reservation_ttl_s,
            check_fit=False,
        )
        try:
            ok = await gw.ledger.reserve(name, ctx.reservation_id, reserve)
        except StoreUnavailable:
            ok = True
        if ok:
            gw.queues.handed_over(name, ctx.demand, now, why)
            return name
    return None
