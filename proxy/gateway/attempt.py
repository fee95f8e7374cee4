"""Step 6 of the walk: one attempt on one backend, from sending the request to an answer.

The attempt either ends the request (an answer or a stream for the client) or diverts
(``None``): the reservation is freed and placement tries the next candidate. Upstream
failures arrive as ``proxy.errors.UpstreamError`` (the client maps the library's errors);
whatever else interrupts the attempt (a cancelled request) still frees the reservation.

Until the answer starts, the client is watched: if it goes away, the attempt is cancelled at
once (the upstream connection is dropped, so the backend sees the cancel) and the reservation
released, rather than holding both until the backend finishes.

A non-streamed answer's headers come only with its last token, so the time to its headers is
the whole generation: it gets ``ttfb_timeout_s`` plus ``non_stream_s_per_token`` for each
requested output token (within the total deadline), not ``ttfb_timeout_s`` alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from starlette.responses import Response

from proxy.core.validation import Endpoint
from proxy.errors import UpstreamConnectError, UpstreamError, upstream_answer
from proxy.gateway.answers import broken_answer, error_answer, whole_answer
from proxy.gateway.client_watch import ClientWatch
from proxy.gateway.context import FAILURE_RESULTS, RequestContext
from proxy.gateway.divert import divert
from proxy.gateway.stream import start_stream
from proxy.upstream.client import UpstreamAnswer, with_credential
from proxy.upstream.client_auth import upstream_credential

if TYPE_CHECKING:
    from proxy.gateway.walk import Gateway

log = logging.getLogger("kvroute.gateway")

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
T = TypeVar("T")
# What to do with a streamed 2xx (``start_stream``; a continuation has its own step):
# (gateway, context, backend, answer, started, ttfb deadline) -> a result, or None to divert.
StreamStep = Callable[
    ["Gateway", RequestContext, str, UpstreamAnswer, float, float], Awaitable[T | None]
]


async def forward(gw: Gateway, ctx: RequestContext, backend: str) -> Response | None:
    """Forward to ``backend``. A Response ends the request; None means divert to another node."""
    # A client that leaves cancels the attempt at once: its cleanup drops the upstream
    # connection and frees the reservation.
    with ClientWatch(ctx.request.receive):
        return await send_attempt(gw, ctx, backend, start_stream)
    # Reached only when the watch suppressed its own cancellation: the client went away.
    return _client_left(gw, ctx, backend)


def _client_left(gw: Gateway, ctx: RequestContext, backend: str) -> Response:
    log.info("request %s: the client went away while %s worked on it", ctx.request_id, backend)
    gw.metrics.requests.labels(ctx.cls, backend, "client_disconnect").inc()
    # Nobody reads it: the connection is gone.
    return Response(status_code=499)


def headers_deadline(gw: Gateway, ctx: RequestContext, now: float) -> float:
    """When the backend's response headers must have come (the loop's clock)."""
    up = ctx.cfg.upstream
    limit = up.ttfb_timeout_s
    if not ctx.parsed.stream:
        limit += up.non_stream_s_per_token * (ctx.demand - ctx.prompt_tokens)
    return min(now + limit, ctx.deadline)


async def send_attempt(
    gw: Gateway, ctx: RequestContext, backend: str, stream_step: StreamStep[T]
) -> Response | T | None:
    """Send ``ctx.parsed`` to ``backend``: an answer, ``stream_step``'s result, or None (divert).

    Not watching the client: ``forward`` does that; a continuation runs inside a stream whose
    own relay already does (``proxy.gateway.continuation``).
    """
    url = gw.urls[backend] + PATHS[ctx.parsed.endpoint]
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    ttfb_deadline = headers_deadline(gw, ctx, loop.time())
    resp: UpstreamAnswer | None = None
    credential = upstream_credential(
        ctx.cfg.auth, ctx.upstream_headers, gw.credentials.get(backend)
    )
    headers = with_credential(ctx.upstream_headers, credential)
    try:
        try:
            resp = await gw.upstream.post(url, ctx.parsed.raw, headers, ttfb_deadline - loop.time())
        except UpstreamError as exc:
            _not_answered(gw, ctx, backend, exc, ttfb_deadline >= ctx.deadline)
            return None
        if resp.status >= 400:
            return await error_answer(gw, ctx, backend, resp)
        if resp.status >= 300:
            # Not followed (the prompt would go elsewhere) and not relayed: a broken answer.
            message = f"backend {backend} answered a redirect (HTTP {resp.status})"
            broken_answer(gw, ctx, backend, resp, "bad_response", message)
            return None
        if ctx.parsed.stream and resp.headers.get("content-type", "").lower().startswith(
            "text/event-stream"
        ):
            return await stream_step(gw, ctx, backend, resp, started, ttfb_deadline)
        return await whole_answer(gw, ctx, backend, resp, started)
    except BaseException:
        if resp is not None:
            resp.close()
        gw.release_later(ctx, backend)
        raise


def _not_answered(
    gw: Gateway, ctx: RequestContext, backend: str, exc: UpstreamError, at_deadline: bool
) -> None:
    """No response headers came: the backend timed out or could not be reached.

    ``at_deadline``: the wait was cut by the request's own total deadline; a timeout then is
    answered as the total time running out and not held against the backend.
    """
    failure = exc.failure
    ours = at_deadline and failure == "ttfb_timeout"
    if isinstance(exc, UpstreamConnectError):
        message = f"backend {backend} could not be reached: {exc}"
    elif ours:
        failure = "total_timeout"
        message = f"backend {backend} did not answer within the request's total time limit"
    else:
        message = f"backend {backend} did not answer: {exc}"
    answer = upstream_answer(failure, message)
    divert(
        gw,
        ctx,
        backend,
        answer,
        result=FAILURE_RESULTS[failure],
        broken=str(exc),
        out_of_time=ours,
    )
