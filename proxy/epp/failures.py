"""What an error answer teaches, read as the gateway reads it before diverting.

Behind the EPP the gateway (Envoy) forwards, so kvroute cannot retry the request elsewhere;
but the next requests must still learn from this one. The answer is classified as in
``proxy.gateway.answers`` (the generic reading, then the backend kind's own):

- the client's own mistake (4xx): relayed, the backend healthy;
- an allocation failure: the backend is alive but could not fit this size now. It is
  booked through ``divert`` with ``full`` (a learned ceiling for this size, the client's
  retry key kept off it) and counted as the gateway counts it
  (``kvroute_allocation_failures_total``, fragmentation or capacity);
- overload (429/503): a cooldown by its Retry-After, no ejection;
- any other 5xx: a failure toward outlier ejection.

``divert`` frees the reservation itself, so a caller told ``released`` must not again.
"""

from __future__ import annotations

from typing import NamedTuple

from proxy.gateway.answers import by_kind, cause_at_backend
from proxy.gateway.context import RequestContext, RequestResult
from proxy.gateway.divert import divert, record_allocation_failure, verdict_for
from proxy.gateway.walk import Gateway
from proxy.upstream.classify import classify_response


class Booked(NamedTuple):
    outcome: RequestResult
    # The reservation was freed here (by ``divert``).
    released: bool


def book_error(
    gw: Gateway,
    ctx: RequestContext,
    backend: str,
    status: int,
    body: bytes,
    retry_after: str | None,
) -> Booked:
    """Book an error answer of ``backend``, the backend holding the request's reservation."""
    verdict = by_kind(gw, ctx, backend, classify_response(status, body, retry_after), status, body)
    if verdict.verdict == "client_error":
        gw.metrics.labelled(gw.metrics.attempts, backend, "client_error").inc()
        gw.health.success(backend)
        return Booked("rejected", False)
    if verdict.verdict == "allocation":
        divert(
            gw,
            ctx,
            backend,
            None,
            result="allocation",
            full=True,
            retry_after_s=verdict.retry_after_s,
        )
        cause = cause_at_backend(verdict, ctx.demand, backend, ctx.snap)
        view = gw.local.apply(ctx.snap)
        record_allocation_failure(
            gw, backend, cause, ctx.demand, verdict_for(gw, ctx, view, gw.clock())
        )
        return Booked("allocation_failure", True)
    overload = verdict.verdict == "overload"
    divert(
        gw,
        ctx,
        backend,
        None,
        result="overload" if overload else "server_error",
        broken=None if overload else f"HTTP {status}",
        retry_after_s=verdict.retry_after_s,
    )
    return Booked("upstream_error", True)
