"""Steps 4-5 of the walk: rank the candidates, reserve on the best one that accepts, or wait.

A retry after an upstream failure spends the retry budget; a request that fits nowhere now
waits in the bounded admission queue for a report that shows a big enough block; when
nothing can take it, the answer says why, by one per-node test (``proxy.routing.nothing_fits``):
``unavailable`` (every node down, draining, stale, cooling down or excluded: answered at once,
since waiting for memory cannot help), ``fragmentation`` or ``capacity``.

Ranking reads the cached fleet snapshot with this replica's own reservations in flight laid
over it (``proxy.gateway.local_view``), so a burst spreads instead of piling on one node.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, Literal, Protocol

from starlette.responses import Response

from proxy.core.fleet import FleetSnapshot
from proxy.gateway import queueing
from proxy.gateway.admission import Admission
from proxy.gateway.affinity import Affinity
from proxy.gateway.client_watch import ClientWatch
from proxy.gateway.context import RequestContext
from proxy.gateway.divert import DivertPorts, verdict_for
from proxy.gateway.early_prefills import EarlyPrefillBook
from proxy.gateway.held_room import kept_for, nodes_kept
from proxy.gateway.hold_prefill import prefill_due, prefill_pending
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.local_view import LocalReservations
from proxy.gateway.placement_answers import (
    client_left_while_held,
    give_up,
    nothing_fits,
    out_of_time,
)
from proxy.gateway.queueing import QueueingPorts
from proxy.gateway.retry_budget import RetryBudget, retry_slot
from proxy.routing.nothing_fits import NothingFits
from proxy.routing.policy import RouteRequest
from proxy.state.base import StoreUnavailable
from proxy.state.fleet_cache import FleetCache


class PlacementPorts(DivertPorts, QueueingPorts, Protocol):
    """What ranking and reserving use: the fleet view and this replica's reservations laid
    over it, affinity, the ledger, the retry budget and the admission queue; and step 1 of a
    held two-step request (``proxy.gateway.hold_prefill``)."""

    fleet: FleetCache
    local: LocalReservations
    affinity: Affinity
    ledger: ReservationLedger
    budget: RetryBudget
    admission: Admission
    # Requests in flight on this replica (the retry budget's share is of these).
    active: int
    # Prefills run during a decode hold, capped per prefill server.
    early_prefills: EarlyPrefillBook

    def prefill_during_hold(self, ctx: RequestContext) -> Awaitable[Response | None]:
        """Step 1 of a held two-step request (``disaggregated``, which places through
        here); a Response ends the request."""
        ...


async def place(gw: PlacementPorts, ctx: RequestContext) -> str | Response:
    """The backend that now holds this request's reservation, or the request's final answer."""
    try:
        placed = await _place(gw, ctx)
    except BaseException:
        gw.pressure.not_placed(ctx)
        raise
    if isinstance(placed, str):
        # No await since the reservation: the flight is counted before anyone else ranks.
        gw.pressure.placed(ctx, placed)
    else:
        gw.pressure.not_placed(ctx)
    return placed


async def _place(gw: PlacementPorts, ctx: RequestContext) -> str | Response:
    loop = asyncio.get_running_loop()
    while ctx.attempts < ctx.cfg.retry.max_attempts:
        if loop.time() >= ctx.deadline:
            # No attempt after the request's own deadline: it could only time out, and
            # would count against a backend that did nothing wrong.
            return out_of_time(gw, ctx)
        avoid = gw.health.avoid() | ctx.ruled_out | ctx.exclude
        now = gw.clock()
        view, request, ranked = _rank(gw, ctx, avoid, now)
        verdict = None if ranked else verdict_for(gw, ctx, view, now)
        if ctx.failure is not None:
            if verdict is not None and verdict.cause == "unavailable":
                # No other backend can serve, now or later: the last failure is the answer.
                return give_up(gw, ctx)
            if not await _retry_slot_once(gw, ctx):
                return give_up(gw, ctx)
        demands = (
            {n: gw.affinity.demand_on(request, view, n) for n in ranked} if request.cached else None
        )
        unchecked = gw.pressure.decided_here(view, ranked)
        backend = await reserve_first(gw, ctx, ranked, now, demands, unchecked=unchecked)
        if backend is not None:
            _begin_attempt(gw, ctx)
            queueing.predict_ttft(gw, ctx, view, backend)
            return backend
        verdict = verdict or verdict_for(gw, ctx, view, now)
        if verdict.cause == "unavailable":
            # An outage: no report will make room, so the queue would only delay the 503.
            return give_up(gw, ctx) if ctx.failure is not None else nothing_fits(gw, ctx, verdict)
        # A retry that nothing takes now is held as a first attempt is: the backends left
        # are busy, not gone, and one of them can still serve it.
        held = await _hold(gw, ctx, view, avoid)
        if held is not None:
            return held
    if ctx.failure is not None:
        return give_up(gw, ctx)
    return nothing_fits(gw, ctx, _verdict_now(gw, ctx), exhausted=True)


async def watched_hold(
    gw: PlacementPorts, ctx: RequestContext, avoid: frozenset[str], deadline: float
) -> FleetSnapshot | Literal["hand_over", "prefill"] | Response | None:
    """``wait_for_fit``, the client watched: one that leaves ends its hold (and its place in
    line) at once, not when the hold runs out."""
    with ClientWatch(ctx.request.receive):
        return await wait_for_fit(gw, ctx, avoid, deadline)
    # Reached only when the watch suppressed its own cancellation: the client went away.
    return client_left_while_held(gw, ctx)


def hold_limit_s(gw: PlacementPorts, ctx: RequestContext, view: FleetSnapshot) -> float:
    """The longest hold: ``queue.max_wait_s``, or longer where a lazily allocating node waits.

    A hold for a queueing backend ends by joining its queue, never in a 503, so holding it
    longer (``memory_pressure.max_hold_s``) only trades a preemption for a wait at the gateway.
    """
    limit = ctx.cfg.queue.max_wait_s
    if gw.pressure.enabled and any(n.report is not None and n.report.queueing for n in view.nodes):
        limit = max(limit, gw.pressure.max_hold_s)
    return limit


def _verdict_now(gw: PlacementPorts, ctx: RequestContext) -> NothingFits:
    return verdict_for(gw, ctx, gw.local.apply(ctx.snap), gw.clock())


async def _retry_slot_once(gw: PlacementPorts, ctx: RequestContext) -> bool:
    """The retry budget's slot for the retry now due, taken once whether the retry is placed
    at once or after a hold (``retry_slot``; given back when the request ends)."""
    if ctx.retry_slot_taken:
        return True
    ctx.retry_slot_taken = await retry_slot(gw, ctx)
    return ctx.retry_slot_taken


def _begin_attempt(gw: PlacementPorts, ctx: RequestContext) -> None:
    ctx.attempts += 1
    ctx.retry_slot_taken = False
    if ctx.attempts > 1:
        gw.metrics.retries.labels(
            "upstream_failure" if ctx.failure is not None else "diverted"
        ).inc()
    ctx.failure = None


async def move_on(gw: PlacementPorts, ctx: RequestContext, backend: str) -> None:
    """The attempt on ``backend`` was diverted: leave it out and look at a fresh snapshot."""
    ctx.exclude.add(backend)
    ctx.snap = await gw.fleet.snapshot()


async def _hold(
    gw: PlacementPorts, ctx: RequestContext, view: FleetSnapshot, avoid: frozenset[str]
) -> str | Response | None:
    """Nothing took the request now: hand it to a backend's queue, wait for room, or answer
    why not. None: rank again (on the snapshot that showed room, or after a lost hand-over)."""
    if queueing.hold_over(gw, ctx, view, avoid):
        # A queueing backend with KV room, only its queue full: no hold at all.
        if (queued := await join_queue(gw, ctx, avoid, recheck=True)) is not None:
            return queued
    if ctx.queue_deadline is None:
        ctx.queue_deadline = time.monotonic() + hold_limit_s(gw, ctx, view)
    waited = await watched_hold(gw, ctx, avoid, ctx.queue_deadline)
    if isinstance(waited, Response):
        # The client went away while held.
        return waited
    if waited == "prefill":
        # Step 1 now; then placed as any held request whose prompt is computed.
        return await gw.prefill_during_hold(ctx)
    if waited == "hand_over":
        # None: the room went to a request that joined first, hold again.
        return await join_queue(gw, ctx, avoid, recheck=True)
    if waited is None:
        # Queueing backends (vLLM, SGLang, TGI) are a place to wait, never a 503.
        if (queued := await join_queue(gw, ctx, avoid)) is not None:
            return queued
        return nothing_fits(gw, ctx, _verdict_now(gw, ctx), exhausted=ctx.attempts > 0)
    ctx.snap = waited
    return None


def _rank(
    gw: PlacementPorts, ctx: RequestContext, avoid: frozenset[str], now: float
) -> tuple[FleetSnapshot, RouteRequest, list[str]]:
    """The view ranked (in-flight reservations and projected KV peaks laid over the cached
    snapshot), the request as ranked (affinity may lower its demand), and the candidates."""
    view = gw.pressure.apply(gw.local.apply(ctx.snap), ctx, now)
    # Older held requests overtaken their limit: the nodes kept for them (None: all).
    kept = nodes_kept(gw.pressure, ctx, view, avoid)
    avoid |= kept or frozenset()
    # While the model's TTFT predictions miss, queueing nodes rank as a blind router ranks.
    request = RouteRequest(ctx.demand, ctx.cls, avoid, blind=gw.ttft_check.blind)
    request = gw.affinity.route_request(ctx.affinity, request, view, now)
    ranked = ctx.policy.rank(view, request, now) if kept is not None else []
    if not ctx.decided:
        gw.metrics.decision.observe(time.perf_counter() - ctx.started)
        ctx.decided = True
    return view, request, ranked


def _store_reserve(
    gw: PlacementPorts, ctx: RequestContext, name: str, tokens: int, now: float, check_fit: bool
) -> functools.partial[Coroutine[Any, Any, bool]]:
    """The store call that reserves ``tokens`` on ``name`` (the ledger makes it, and retries it)."""
    return functools.partial(
        gw.store.reserve,
        name,
        ctx.reservation_id,
        tokens,
        now,
        ctx.cfg.store.reservation_ttl_s,
        check_fit=ctx.policy.checks_fit and check_fit,
        headroom=ctx.cfg.routing.safety_margin,
        grace_s=ctx.cfg.store.report_grace_s,
    )


async def reserve_first(
    gw: PlacementPorts,
    ctx: RequestContext,
    ranked: list[str],
    now: float,
    demands: dict[str, int] | None = None,
    check_fit: bool = True,
    unchecked: frozenset[str] = frozenset(),
) -> str | None:
    """Reserve on the best candidate that accepts; a lost race moves on to the next.

    ``demands``: what to reserve per node where it differs from the request's demand (a
    cached prefix that the server reuses, ``proxy.gateway.affinity``).
    ``check_fit=False``: the reservation is taken whatever the memory figures (a queueing
    backend's own queue is where the request waits); ``unchecked``: the nodes where so
    (the memory-pressure projection decided the fit, ``MemoryPressure.decided_here``).
    """
    for name in ranked:
        tokens = demands.get(name, ctx.demand) if demands else ctx.demand
        # Counted in this replica's view before the store answers: concurrent requests
        # ranking meanwhile already see it.
        gw.local.add(name, ctx.reservation_id, tokens)
        try:
            checked = check_fit and name not in unchecked
            reserve = _store_reserve(gw, ctx, name, tokens, now, checked)
            # The ledger holds whatever the call may reserve, also when this request is
            # cancelled while the call is in flight or the store times out (it may still land).
            # The embedded store's call runs to its end at once (no await).
            ok = gw.ledger.reserve_at_once(
                name, ctx.reservation_id, reserve, tokens=tokens, created_at=now
            )
            if ok is None:
                ok = await gw.ledger.reserve(
                    name, ctx.reservation_id, reserve, tokens=tokens, created_at=now
                )
        except StoreUnavailable:
            # Degraded: route without a shared reservation rather than fail (counted locally).
            gw.affinity.placed(ctx.affinity, name, now)
            return name
        except BaseException:
            gw.local.remove(name, ctx.reservation_id)
            raise
        if ok:
            gw.local.confirm(name, ctx.reservation_id, gw.fleet.clock(), created_at=now)
            gw.affinity.placed(ctx.affinity, name, now)
            return name
        gw.local.remove(name, ctx.reservation_id)
    return None


async def join_queue(
    gw: PlacementPorts, ctx: RequestContext, avoid: frozenset[str], recheck: bool = False
) -> str | None:
    """Hand the request to the queueing backend expected to start it soonest (or None).

    A reservation taken there begins the attempt.

    ``recheck``: only if the hold is still over on the fresh view. Several held requests
    see the same room free up; the first to join takes it, and the others, projected with
    it, hold again instead of all joining into a preemption.
    """
    ctx.snap = await gw.fleet.snapshot(force=True)
    now = gw.clock()
    view = gw.pressure.apply(gw.local.apply(ctx.snap), ctx, now)
    if recheck and gw.pressure.enabled and not queueing.hold_over(gw, ctx, view, avoid):
        return None
    avoid |= kept_for(gw.pressure, ctx) if recheck else frozenset()
    names = [name for name, _ in gw.queues.ranked(ctx, view, avoid, now)]
    if not recheck:
        # The hold ran its limit: a server that queues rather than refuses is a place to wait.
        names += gw.queues.deferring(ctx, view, avoid, now)
    backend = await reserve_first(gw, ctx, names, now, check_fit=False)
    if backend is not None:
        # ``why``: the hold ended early for that queue (hold_over), or ran its limit.
        gw.queues.handed.labels(backend, "hold_over" if recheck else "hold_limit").inc()
        _begin_attempt(gw, ctx)
        queueing.predict_ttft(gw, ctx, view, backend)
    return backend


async def wait_for_fit(
    gw: PlacementPorts, ctx: RequestContext, exclude: frozenset[str], deadline: float
) -> FleetSnapshot | Literal["hand_over", "prefill"] | None:
    """The admission queue: wait (bounded) for a report that shows a big enough block.

    ``"hand_over"``: a queueing backend's queue is now the better place (``hold_over``);
    ``"prefill"``: a prefill server has its share free for this request's step 1
    (``hold_prefill``); None: the wait's time ran out or the admission queue is full.
    """
    if time.monotonic() >= deadline or not gw.admission.try_enter():
        return None
    gw.metrics.queue_depth.set(gw.admission.depth)
    start = time.monotonic()
    if ctx.hold_started is None:
        ctx.hold_started = start
    if not prefill_pending(ctx):
        # One whose prompt is still to be computed takes no place in line until then: it
        # could not use a room kept for it (``hold_prefill``).
        gw.pressure.order.hold(ctx.reservation_id)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await gw.admission.wait(min(remaining, 0.05))
            snap = await gw.fleet.snapshot(force=True)
            # The latest view, also for the answer's verdict if the wait ends with nothing.
            ctx.snap = snap
            avoid = exclude | gw.health.avoid()
            now = gw.clock()
            view = gw.pressure.apply(gw.local.apply(snap), ctx, now)
            kept = nodes_kept(gw.pressure, ctx, view, avoid)
            request = RouteRequest(ctx.demand, ctx.cls, avoid | (kept or frozenset()))
            if kept is not None and ctx.policy.rank(view, request, now):
                return snap
            if queueing.hold_over(gw, ctx, view, request.exclude):
                return "hand_over"
            if prefill_due(gw.early_prefills, ctx):
                return "prefill"
    finally:
        gw.admission.leave()
        gw.metrics.queue_depth.set(gw.admission.depth)
        gw.metrics.queue_wait.observe(time.monotonic() - start)
