"""The answers placement gives when it places nothing: the last failure, a timeout, a 503
that says why nothing fits, or nothing at all for a client that left.

Each counts the request once on ``kvroute_requests_total`` by how it ended.
"""

from __future__ import annotations

import logging

from starlette.responses import Response

from proxy.errors import ApiError, upstream_answer
from proxy.gateway.context import RequestContext
from proxy.gateway.divert import DivertPorts, record_allocation_failure
from proxy.routing.nothing_fits import NothingFits

log = logging.getLogger("kvroute.gateway")
# The status of an answer to a client that left (nobody reads it), as ``attempt`` answers it.
CLIENT_LEFT = 499


def client_left_while_held(gw: DivertPorts, ctx: RequestContext) -> Response:
    """The client went away during the hold: nothing was reserved; nobody reads the answer."""
    log.info("request %s: the client went away while it was held", ctx.request_id)
    if ctx.counts_request:
        gw.metrics.requests.labels(ctx.cls, "none", "client_disconnect").inc()
    return Response(status_code=CLIENT_LEFT)


def give_up(gw: DivertPorts, ctx: RequestContext) -> Response:
    """The last upstream failure is the answer: count the request once, by that outcome."""
    assert ctx.failure is not None
    backend = ctx.failed_on[-1] if ctx.failed_on else "none"
    if ctx.counts_request:
        gw.metrics.requests.labels(ctx.cls, backend, ctx.failure_outcome).inc()
    return ctx.failure


def out_of_time(gw: DivertPorts, ctx: RequestContext) -> Response:
    """The request's total time ran out between attempts: its last failure, or a 504."""
    if ctx.failure is None:
        limit = ctx.cfg.upstream.total_timeout_s
        ctx.failure = upstream_answer(
            "total_timeout", f"the request ran past its total time limit ({limit:g}s)"
        )
        ctx.failure.headers.update(ctx.answer_headers(ctx.backend or "none"))
        ctx.failure_outcome = "upstream_timeout"
    return give_up(gw, ctx)


def nothing_fits(
    gw: DivertPorts, ctx: RequestContext, verdict: NothingFits, exhausted: bool = False
) -> Response:
    """A 503 that says why nothing can take the request: an outage, fragmentation or capacity."""
    cause, why = verdict.cause, verdict.message
    if exhausted and ctx.failed_on:
        why = f"tried {', '.join(ctx.failed_on)}: all failed; " + why
    record_allocation_failure(gw, "", cause, ctx.demand, verdict)
    retry_after = {"retry-after": str(ctx.cfg.queue.retry_after_s)}
    # Step 1 of two is not the request: what fails there is not its outcome.
    counted = ctx.counts_request
    if cause == "unavailable":
        if counted:
            gw.metrics.requests.labels(ctx.cls, "none", "unavailable").inc()
        err = ApiError(
            503,
            why,
            type="service_unavailable",
            code="no_backend_available",
            headers=retry_after,
            extra={
                "cause": cause,
                "demand_tokens": ctx.demand,
                "backends_reachable": verdict.reachable,
                "backends": verdict.total,
            },
        )
    else:
        if counted:
            gw.metrics.requests.labels(ctx.cls, "none", "no_fit").inc()
        err = ApiError(
            503,
            why,
            type="kv_cache_unavailable",
            code=f"no_backend_fits_{cause}",
            headers=retry_after,
            extra={"cause": cause, "demand_tokens": ctx.demand},
        )
    return err.response(ctx.answer_headers(ctx.backend or "none"))
