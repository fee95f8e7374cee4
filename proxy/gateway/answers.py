"""Step 6 for answers that are not a stream: a backend's error status, or a whole 2xx body.

An error status is classified (``proxy.upstream.classify``): the client's own mistake is
relayed as is; an allocation failure diverts and teaches the fleet a ceiling; overload and
server errors divert and, when nobody else serves, become the answer. A 2xx body is read in
full before anything reaches the client, so a body that stalls or breaks can still divert.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol

from starlette.responses import Response

from proxy.core.fleet import FailureCause, FleetSnapshot, classify_failure
from proxy.core.sample_gate import SampleGate
from proxy.errors import ApiError, UpstreamBroken, UpstreamFailure, upstream_answer
from proxy.gateway.context import FAILURE_RESULTS, AttemptResult, RequestContext
from proxy.gateway.divert import DivertPorts, divert, record_allocation_failure, verdict_for
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.local_view import LocalReservations
from proxy.gateway.memory_pressure import MemoryPressure
from proxy.gateway.models import KindErrors
from proxy.gateway.token_counts import TokenCounts
from proxy.gateway.ttft_check import TtftCheck
from proxy.upstream.classify import (
    UpstreamVerdict,
    Verdict,
    classify_response,
    is_json_object,
    json_object,
)
from proxy.upstream.client import (
    AnswerTooLarge,
    BodyTimeout,
    UpstreamAnswer,
    read_body,
    read_limited,
    response_headers,
)

log = logging.getLogger("kvroute.gateway")


class AnswerPorts(DivertPorts, Protocol):
    """What reading a backend's answer uses: its kind's error reading, the reservations it
    frees or confirms, the KV projection and the servers' token counts."""

    kind_errors: KindErrors
    local: LocalReservations
    ledger: ReservationLedger
    pressure: MemoryPressure
    # Predicted against observed TTFT (checked at a stream's first event).
    ttft_check: TtftCheck
    token_counts: TokenCounts
    # What the two learn from whole answers, at most so many a second per model.
    answer_samples: SampleGate


# Of a failed backend's headers, only Retry-After reaches the client.
_RETRY_AFTER = frozenset({"retry-after"})


def broken_answer(
    gw: AnswerPorts,
    ctx: RequestContext,
    backend: str,
    resp: UpstreamAnswer,
    failure: UpstreamFailure,
    message: str,
) -> None:
    """The backend's answer broke before reaching the client: drop its connection and divert.

    A body cut short by the request's own total deadline is not held against the backend.
    """
    resp.close()
    answer = upstream_answer(failure, message)
    ours = failure == "total_timeout"
    divert(
        gw, ctx, backend, answer, result=FAILURE_RESULTS[failure], broken=message, out_of_time=ours
    )


async def error_answer(
    gw: AnswerPorts, ctx: RequestContext, backend: str, resp: UpstreamAnswer
) -> Response | None:
    """A 4xx/5xx from ``backend``: relay the client's own mistake, divert anything else."""
    try:
        async with asyncio.timeout(ctx.cfg.upstream.idle_timeout_s):
            body = await read_limited(resp)
    except (UpstreamBroken, TimeoutError):
        body = b""
    finally:
        resp.close()
    generic = classify_response(resp.status, body, resp.headers.get("retry-after"))
    verdict = by_kind(gw, ctx, backend, generic, resp.status, body)
    if verdict.verdict == "client_error":
        gw.metrics.attempts.labels(backend, verdict.verdict).inc()
        gw.health.success(backend)
        gw.local.remove(backend, ctx.reservation_id)
        gw.pressure.ended(ctx, backend)
        await gw.ledger.release(backend, ctx.reservation_id)
        gw.metrics.requests.labels(ctx.cls, backend, "rejected").inc()
        headers = ctx.answer_headers(backend, response_headers(resp.headers))
        return Response(body, status_code=resp.status, headers=headers)
    if verdict.verdict == "allocation":
        return _allocation_failed(gw, ctx, backend, resp, body, verdict)
    _failed_or_busy(gw, ctx, backend, resp, body, verdict)
    return None


def by_kind(
    gw: AnswerPorts,
    ctx: RequestContext,
    backend: str,
    verdict: UpstreamVerdict,
    status: int,
    body: bytes,
) -> UpstreamVerdict:
    """The backend kind's own reading of its error (TGI's 424 out of memory is an allocation
    failure, its 429 overload). An allocation failure the generic reading already recognised
    (the kvroute contract's exact error, a KV phrase) is never downgraded."""
    if verdict.verdict == "allocation":
        return verdict
    try:
        kind = ctx.cfg.backend(backend).kind
        read = _KIND_VERDICTS.get(gw.kind_errors(kind, status, body) or "")
    except KeyError:
        return verdict
    return dataclasses.replace(verdict, verdict=read) if read is not None else verdict


_KIND_VERDICTS: dict[str, Verdict] = {
    "allocation": "allocation",
    "overload": "overload",
    "client_error": "client_error",
    "server_error": "server_error",
}


def _allocation_failed(
    gw: AnswerPorts,
    ctx: RequestContext,
    backend: str,
    resp: UpstreamAnswer,
    body: bytes,
    verdict: UpstreamVerdict,
) -> Response | None:
    """The backend could not fit the request: divert; on the last attempt its answer is ours."""
    divert(
        gw, ctx, backend, None, result="allocation", full=True, retry_after_s=verdict.retry_after_s
    )
    cause = cause_at_backend(verdict, ctx.demand, backend, ctx.snap)
    now = gw.clock()
    record_allocation_failure(
        gw, backend, cause, ctx.demand, verdict_for(gw, ctx, gw.local.apply(ctx.snap), now)
    )
    log.info(
        "request %s: %s could not allocate %d tokens (%s); diverting",
        ctx.request_id,
        backend,
        ctx.demand,
        cause,
    )
    if ctx.attempts < ctx.cfg.retry.max_attempts:
        return None
    if ctx.counts_request:
        gw.metrics.requests.labels(ctx.cls, backend, "allocation_failure").inc()
    headers = ctx.answer_headers(backend, response_headers(resp.headers), only=_RETRY_AFTER)
    return Response(body, status_code=resp.status, headers=headers, media_type="application/json")


def _failed_or_busy(
    gw: AnswerPorts,
    ctx: RequestContext,
    backend: str,
    resp: UpstreamAnswer,
    body: bytes,
    verdict: UpstreamVerdict,
) -> None:
    """Overload (429/503) or another 5xx: a failure of this backend; another may serve."""
    kept = {k: v for k, v in response_headers(resp.headers).items() if k.lower() in _RETRY_AFTER}
    answer: Response
    if is_json_object(body):
        answer = Response(
            body, status_code=resp.status, headers=kept, media_type="application/json"
        )
    else:
        status = resp.status if resp.status in (429, 503) else 502
        answer = ApiError(
            status,
            f"backend {backend} answered HTTP {resp.status}",
            type="upstream_error",
            code="upstream_server_error",
            headers=kept,
        ).response()
    result: AttemptResult = "overload" if verdict.verdict == "overload" else "server_error"
    # A 429 is busy, not broken: no ejection, but still try another.
    broken = f"HTTP {resp.status}" if resp.status >= 500 else None
    divert(
        gw, ctx, backend, answer, result=result, broken=broken, retry_after_s=verdict.retry_after_s
    )


def cause_at_backend(
    verdict: UpstreamVerdict, demand: int, backend: str, snap: FleetSnapshot
) -> FailureCause:
    """Fragmentation when the backend had enough free memory in total (its error's figure,
    else its last report), else capacity."""
    free = verdict.free_tokens
    if free is None:
        node = snap.by_name().get(backend)
        free = node.report.free_tokens if node is not None and node.report is not None else None
    return classify_failure(demand, free)


async def whole_answer(
    gw: AnswerPorts, ctx: RequestContext, backend: str, resp: UpstreamAnswer, started: float
) -> Response | None:
    """A non-streamed 2xx: read it all (nothing reached the client yet, so a failure may still divert)."""
    try:
        body = await read_body(
            resp, ctx.cfg.upstream.idle_timeout_s, ctx.deadline, ctx.cfg.upstream.max_answer_bytes
        )
    except AnswerTooLarge as exc:
        message = f"backend {backend} sent an answer too large to relay: {exc}"
        broken_answer(gw, ctx, backend, resp, "bad_response", message)
        return None
    except BodyTimeout as exc:
        message = f"backend {backend} stopped answering: {exc}"
        broken_answer(gw, ctx, backend, resp, exc.failure, message)
        return None
    except UpstreamBroken as exc:
        message = f"backend {backend} broke off its answer: {exc.cause}"
        broken_answer(gw, ctx, backend, resp, "broken", message)
        return None
    resp.release()
    answer_json = json_object(body)
    if answer_json is None:
        message = f"backend {backend} sent an answer that is not a JSON object"
        answer = upstream_answer("bad_response", message)
        divert(gw, ctx, backend, answer, result="garbage", broken=message)
        return None
    gw.metrics.labelled(gw.metrics.attempts, backend, "ok").inc()
    gw.health.success(backend)
    ctx.backend = backend
    if gw.answer_samples.take(ctx.parsed.model, time.monotonic()):
        gw.token_counts.observe(ctx.parsed.model, ctx.counted_prompt_tokens, body)
        gw.pressure.answered(ctx, backend, answer_json)
    # Off the answer's path (a Redis round trip).
    gw.tasks.release_later(ctx, backend)
    if ctx.counts_request:
        gw.metrics.labelled(gw.metrics.requests, ctx.cls, backend, "success").inc()
        gw.metrics.labelled(gw.metrics.duration, ctx.cls).observe(time.perf_counter() - started)
    headers = ctx.answer_headers(backend, response_headers(resp.headers))
    return Response(body, status_code=resp.status, headers=headers)
