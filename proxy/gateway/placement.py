"""Steps 4-5 of the walk: rank the candidates, reserve on the best one that accepts, or wait.

A retry after an upstream failure spends the retry budget; a request that fits nowhere now
waits in the bounded admission queue for a report that shows a big enough block; when
nothing can take it, the answer says why (fragmentation or genuine capacity).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from starlette.responses import Response

from proxy.core.fleet import FleetSnapshot
from proxy.errors import ApiError
from proxy.gateway import queueing
from proxy.gateway.context import RequestContext
from proxy.gateway.divert import record_allocation_failure
from proxy.routing.policy import RouteRequest, nothing_fits_reason
from proxy.state.base import StoreUnavailable

if TYPE_CHECKING:
    from proxy.gateway.walk import Gateway


async def place(gw: Gateway, ctx: RequestContext) -> str | Response:
    """The backend that now holds this request's reservation, or the request's final answer."""
    while ctx.attempts < gw.cfg.retry.max_attempts:
        avoid = frozenset(ctx.exclude) | gw.health.avoid() | ctx.ruled_out
        now = gw.clock()
        ranked = gw.policy.rank(ctx.snap, RouteRequest(ctx.demand, ctx.cls, avoid), now)
        if not ctx.decided:
            gw.metrics.decision.observe(time.perf_counter() - ctx.started)
            ctx.decided = True
        if ranked and ctx.failure is not None:
            # A retry of a failed attempt: only within the budget.
            if not gw.budget.try_acquire(gw.active):
                gw.metrics.retries.labels("budget_exhausted").inc()
                return ctx.failure
            ctx.retries += 1
        backend = await reserve_first(gw, ctx, ranked, now)
        if backend is not None:
            _begin_attempt(gw, ctx)
            return backend
        if ctx.failure is not None:
            # No other backend can serve: the last failure is the answer.
            return ctx.failure
        if ctx.queue_deadline is None:
            ctx.queue_deadline = time.monotonic() + gw.cfg.queue.max_wait_s
        waited = await wait_for_fit(gw, ctx, avoid, ctx.queue_deadline)
        if waited is None:
            # Queueing backends (vLLM, SGLang, TGI) are a place to wait, never a 503.
            queued = await queueing.join_queue(gw, ctx, avoid, "hold_over")
            if queued is not None:
                _begin_attempt(gw, ctx)
                return queued
            return nothing_fits(gw, ctx, exhausted=ctx.attempts > 0)
        ctx.snap = waited
    if ctx.failure is not None:
        return ctx.failure
    return nothing_fits(gw, ctx, exhausted=True)


def _begin_attempt(gw: Gateway, ctx: RequestContext) -> None:
    ctx.attempts += 1
    if ctx.attempts > 1:
        gw.metrics.retries.labels(
            "upstream_failure" if ctx.failure is not None else "diverted"
        ).inc()
    ctx.failure = None


async def move_on(gw: Gateway, ctx: RequestContext, backend: str) -> None:
    """The attempt on ``backend`` was diverted: leave it out and look at a fresh snapshot."""
    ctx.exclude.add(backend)
    ctx.snap = await gw.fleet.snapshot()


async def reserve_first(
    gw: Gateway, ctx: RequestContext, ranked: list[str], now: float
) -> str | None:
    """Reserve on the best candidate that accepts; a lost race moves on to the next."""
    for name in ranked:
        try:
            reserve = functools.partial(
                gw.store.reserve,
                name,
                ctx.reservation_id,
                ctx.demand,
                now,
                gw.cfg.store.reservation_ttl_s,
                check_fit=gw.policy.checks_fit,
                headroom=gw.cfg.routing.safety_margin,
                grace_s=gw.cfg.store.report_grace_s,
            )
            # The ledger holds whatever the call may reserve, also when this request is
            # cancelled while the call is in flight or the store times out (it may still land).
            ok = await gw.ledger.reserve(
                name, ctx.reservation_id, reserve, tokens=ctx.demand, created_at=now
            )
        except StoreUnavailable:
            # Degraded: route without a shared reservation rather than fail.
            return name
        if ok:
            return name
    return None


async def wait_for_fit(
    gw: Gateway, ctx: RequestContext, exclude: frozenset[str], deadline: float
) -> FleetSnapshot | None:
    """The admission queue: wait (bounded) for a report that shows a big enough block."""
    if time.monotonic() >= deadline or not gw.admission.try_enter():
        return None
    gw.metrics.queue_depth.set(gw.admission.depth)
    start = time.monotonic()
    if ctx.hold_started is None:
        ctx.hold_started = start
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await gw.admission.wait(min(remaining, 0.05))
            snap = await gw.fleet.snapshot(force=True)
            request = RouteRequest(ctx.demand, ctx.cls, exclude | gw.health.avoid())
            if gw.policy.rank(snap, request, gw.clock()):
                return snap
            if queueing.hold_over(gw, ctx, snap, request.exclude):
                return None
    finally:
        gw.admission.leave()
        gw.metrics.queue_depth.set(gw.admission.depth)
        gw.metrics.queue_wait.observe(time.monotonic() - start)


def nothing_fits(gw: Gateway, ctx: RequestContext, exhausted: bool = False) -> Response:
    """A 503 that says why nothing can take the request: fragmentation or genuine capacity."""
    serving = [n.name for n in ctx.snap.nodes if n.name not in ctx.ruled_out]
    cause, why = nothing_fits_reason(ctx.snap, ctx.demand, gw.clock(), serving)
    if exhausted and ctx.failed_on:
        why = f"tried {', '.join(ctx.failed_on)}: all failed to allocate; " + why
    record_allocation_failure(gw, "", cause, ctx.demand, ctx.snap)
    gw.metrics.requests.labels(ctx.cls, "none", "no_fit").inc()
    err = ApiError(
        503,
        why,
        type="kv_cache_unavailable",
        code=f"no_backend_fits_{cause}",
        headers={"retry-after": str(gw.cfg.queue.retry_after_s)},
        extra={"cause": cause, "demand_tokens": ctx.demand},
    )
    return err.response(ctx.answer_headers(ctx.backend or "none"))
