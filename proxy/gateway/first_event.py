"""The first event of a streamed answer: until it arrives the request can still divert.

A stream that stalls before it, breaks off, or is not server-sent events is a broken answer
(``proxy.gateway.answers``): the reservation is freed and placement tries the next backend.
Used by the walk's relay (``proxy.gateway.stream``) and by a continuation alike.
"""

from __future__ import annotations

import asyncio

from proxy.errors import BodyTimeout, UpstreamBroken
from proxy.gateway.answers import AnswerPorts, broken_answer
from proxy.gateway.context import RequestContext
from proxy.upstream.classify import looks_like_sse
from proxy.upstream.client import UpstreamAnswer, next_chunk


async def first_event(
    gw: AnswerPorts, ctx: RequestContext, backend: str, resp: UpstreamAnswer, ttfb_deadline: float
) -> bytes | None:
    """The stream's first bytes, or None (diverted) when they do not come in time or are not SSE."""
    loop = asyncio.get_running_loop()
    try:
        first = await next_chunk(resp, max(0.001, ttfb_deadline - loop.time()), ctx.deadline)
    except BodyTimeout as exc:
        message = f"backend {backend} sent no first event in time: {exc}"
        broken_answer(gw, ctx, backend, resp, "first_event_timeout", message)
        return None
    except UpstreamBroken as exc:
        message = f"backend {backend} broke off before its first event: {exc.cause}"
        broken_answer(gw, ctx, backend, resp, "broken", message)
        return None
    if not looks_like_sse(first):
        message = f"backend {backend} sent a stream that is not server-sent events"
        broken_answer(gw, ctx, backend, resp, "bad_response", message)
        return None
    gw.metrics.labelled(gw.metrics.attempts, backend, "ok").inc()
    gw.ttft_check.first_event(ctx, backend)
    return first
