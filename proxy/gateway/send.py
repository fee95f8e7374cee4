"""One attempt's send: the request to one backend, until its answer starts or it diverts.

Shared by the walk's attempt (``proxy.gateway.attempt``, which also watches the client) and a
stream's continuation (``proxy.gateway.continuation``, inside a relay that watches it):
what to do with a streamed 2xx is the caller's ``stream_step``. Upstream failures arrive as
``proxy.errors.UpstreamError`` (the client maps the library's errors); whatever else
interrupts the send (a cancelled request) still frees the reservation.

A non-streamed answer's headers come only with its last token, so the time to its headers is
the whole generation: it gets ``ttfb_timeout_s`` plus ``non_stream_s_per_token`` for each
requested output token (within the total deadline), not ``ttfb_timeout_s`` alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from starlette.responses import Response

from proxy.core.validation import Endpoint
from proxy.errors import UpstreamConnectError, UpstreamError, upstream_answer
from proxy.gateway.answers import AnswerPorts, broken_answer, error_answer, whole_answer
from proxy.gateway.context import FAILURE_RESULTS, RequestContext
from proxy.gateway.divert import divert
from proxy.upstream.client import Upstream, UpstreamAnswer, with_credential, with_engine
from proxy.upstream.client_auth import upstream_credential


class SendPorts(AnswerPorts, Protocol):
    """What sending uses: each backend's URL and credential, and the upstream client."""

    urls: dict[str, str]
    credentials: dict[str, str | None]
    upstream: Upstream


P = TypeVar("P", bound=SendPorts)
PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
T = TypeVar("T")
# What to do with a streamed 2xx (``start_stream``; a continuation has its own step):
# (gateway, context, backend, answer, started, ttfb deadline) -> a result, or None to divert.
StreamStep = Callable[[P, RequestContext, str, UpstreamAnswer, float, float], Awaitable[T | None]]


def headers_deadline(gw: SendPorts, ctx: RequestContext, now: float) -> float:
    """When the backend's response headers must have come (the loop's clock)."""
    up = ctx.cfg.upstream
    limit = up.ttfb_timeout_s
    if not ctx.parsed.stream:
        limit += up.non_stream_s_per_token * (ctx.demand - ctx.prompt_tokens)
    return min(now + limit, ctx.deadline)


async def send_attempt(
    gw: P, ctx: RequestContext, backend: str, stream_step: StreamStep[P, T]
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
    engine = gw.pressure.engine_of(ctx, backend)
    if engine is not None:
        # A data-parallel server: the engine the projection chose (docs/memory-pressure.md).
        headers = with_engine(headers, engine)
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
        gw.tasks.release_later(ctx, backend)
        raise


def _not_answered(
    gw: SendPorts, ctx: RequestContext, backend: str, exc: UpstreamError, at_deadline: bool
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
