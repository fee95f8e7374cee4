"""Diversion bookkeeping, written once: what happens when an attempt fails before any byte
reached the client and the request moves on to another backend.

Whatever the reason (a timeout, a broken connection, a garbage answer, a 5xx, a 429, an
allocation failure) the same rules hold: free the reservation, count the attempt, remember
the backend for the client's own retry, keep the answer to give if nobody else serves. Only
the backend's health differs: broken counts toward ejection, full or busy does not.
"""

from __future__ import annotations

import logging
from typing import Protocol

from starlette.responses import Response

from proxy.core.fleet import FailureCause, FleetSnapshot
from proxy.gateway import retry_memory
from proxy.gateway.context import AttemptResult, RequestContext
from proxy.gateway.ports import SharedPorts
from proxy.routing.nothing_fits import Cause as NothingFitsCause
from proxy.routing.nothing_fits import NothingFits, judge
from proxy.state.base import StateStore

log = logging.getLogger("kvroute.gateway")

# The problem statement's line: an allocation failure above it is not exhaustion.
HIGH_FREE_FRACTION = 0.25


class AllocationFailureHook(Protocol):
    """Told about every allocation failure (``backend`` is "" when nothing fit at the gateway)."""

    def __call__(
        self,
        backend: str,
        cause: FailureCause,
        demand: int,
        fleet_free_fraction: float,
        room_on: tuple[str, ...] = (),
    ) -> None: ...


class DivertPorts(SharedPorts, Protocol):
    """What diversion uses: the shared ports, the store (learned ceilings, cooldowns,
    failed-on lists) and the allocation-failure hooks."""

    store: StateStore
    on_allocation_failure: list[AllocationFailureHook]


def divert(
    gw: DivertPorts,
    ctx: RequestContext,
    backend: str,
    answer: Response | None,
    *,
    result: AttemptResult,
    broken: str | None = None,
    full: bool = False,
    retry_after_s: float | None = None,
    out_of_time: bool = False,
) -> None:
    """Book an attempt on ``backend`` that failed before reaching the client.

    ``answer`` is what the client gets if no other backend serves (None: decided later).
    ``broken`` (the reason) marks a backend fault: it counts toward ejection and is logged.
    ``full`` marks an allocation failure: the backend is alive, and its ceiling is learned.
    ``retry_after_s`` is the backend's own Retry-After, honoured as a cooldown.
    ``out_of_time``: the request's own total deadline ended the attempt, not the backend;
    it is logged but does not count toward ejection.
    """
    if retry_after_s is not None and retry_after_s > 0:
        cool_down(gw, ctx, backend, retry_after_s)
    gw.tasks.release_later(ctx, backend)
    gw.metrics.attempts.labels(backend, result).inc()
    if broken is not None and not out_of_time:
        gw.health.failure(backend)
    elif full:
        # Alive and answering: not a fault, just full.
        gw.health.success(backend)
    ctx.failed_on.append(backend)
    if full:
        ctx.no_room.add(backend)
        _remember_for_retry(gw, ctx, backend)
        _learn_ceiling(gw, ctx, backend, ctx.demand)
    if broken is not None:
        log.warning("request %s: %s failed (%s): %s", ctx.request_id, backend, result, broken)
    if answer is not None:
        answer.headers.update(ctx.answer_headers(backend))
        ctx.failure = answer
        ctx.failure_outcome = "upstream_timeout" if result == "timeout" else "upstream_error"


def _remember_for_retry(gw: DivertPorts, ctx: RequestContext, backend: str) -> None:
    """The client's own retry (same key) must not go back to a node that could not allocate it.

    Only allocation failures: transient ones (429, 5xx, timeouts) are health's business
    (cooldown, outlier ejection), and listing them starved a small fleet's retries.
    """
    if ctx.retry_key is not None:
        key = ctx.retry_key
        ttl = ctx.cfg.retry.retry_key_ttl_s
        item = retry_memory.entry(backend, gw.clock())
        gw.tasks.spawn(
            gw.tasks.store_quietly("add_failed", lambda: gw.store.add_failed(key, item, ttl))
        )


def _learn_ceiling(gw: DivertPorts, ctx: RequestContext, backend: str, demand: int) -> None:
    """Remember "``backend`` cannot fit ``demand`` now" until its next report or the TTL."""
    now = gw.clock()
    until = now + ctx.cfg.retry.ceiling_ttl_s
    gw.tasks.spawn(
        gw.tasks.store_quietly(
            "set_ceiling", lambda: gw.store.set_ceiling(backend, demand, now, until)
        )
    )


def cool_down(gw: DivertPorts, ctx: RequestContext, backend: str, retry_after_s: float) -> None:
    """Honour a backend's Retry-After: no traffic from this replica (and, via the store, any) for a while."""
    seconds = min(retry_after_s, ctx.cfg.retry.max_retry_after_s)
    if seconds <= 0:
        return
    gw.health.cooldown(backend, seconds)
    until = gw.clock() + seconds
    gw.tasks.spawn(
        gw.tasks.store_quietly("set_cooldown", lambda: gw.store.set_cooldown(backend, until))
    )


def record_allocation_failure(
    gw: DivertPorts, backend: str, cause: NothingFitsCause, demand: int, verdict: NothingFits
) -> None:
    """Count an allocation failure and tell the hooks (the fleet operations' diagnosis).

    ``verdict`` is the per-node test (``proxy.routing.nothing_fits``) over the same view:
    the free fraction is that of the nodes that could have taken the request, so an outage
    or a drained node never fires the high-free-memory alert. An outage (``unavailable``) is
    not an allocation failure and is not recorded here.
    """
    if cause == "unavailable":
        return
    room_on = verdict.room_on
    if backend and cause == "fragmentation" and backend not in room_on:
        room_on = (*room_on, backend)
    gw.metrics.allocation_failures.labels(cause, backend or "none").inc()
    if verdict.free_fraction > HIGH_FREE_FRACTION:
        gw.metrics.failures_high_free.inc()
    for hook in gw.on_allocation_failure:
        hook(
            backend=backend,
            cause=cause,
            demand=demand,
            fleet_free_fraction=verdict.free_fraction,
            room_on=room_on,
        )


def verdict_for(
    gw: DivertPorts, ctx: RequestContext, view: FleetSnapshot, now: float
) -> NothingFits:
    """The per-node test for this request over ``view``.

    Nodes left out for this request's sake (diverted, unhealthy, ejected, cooling down) are
    unavailable; nodes that failed to allocate it are judged on their memory instead.
    """
    exclude = (ctx.exclude - ctx.no_room) | gw.health.avoid()
    if ctx.ruled_out:
        # Backends that do not serve the model (or its length) are not part of the question.
        view = FleetSnapshot(
            tuple(n for n in view.nodes if n.name not in ctx.ruled_out), view.taken_at
        )
    return judge(
        view,
        ctx.demand,
        now,
        stale_after_s=ctx.policy.settings.stale_after_s,
        exclude=exclude,
    )
