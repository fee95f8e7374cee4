"""Step 6 of the walk: one attempt on one backend, from sending the request to an answer.

The attempt either ends the request (an answer or a stream for the client) or diverts
(``None``): the reservation is freed and placement tries the next candidate. Upstream
failures arrive as ``proxy.errors.UpstreamError`` (the client maps the library's errors);
whatever else interrupts the attempt (a cancelled request) still frees the reservation.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from aiohttp import ClientResponse
from starlette.responses import Response

from proxy.core.validation import Endpoint
from proxy.errors import UpstreamConnectError, UpstreamError, upstream_answer
from proxy.gateway.answers import broken_answer, error_answer, whole_answer
from proxy.gateway.context import FAILURE_RESULTS, RequestContext
from proxy.gateway.divert import divert
from proxy.gateway.stream import start_stream
from proxy.upstream.client import with_credential

if TYPE_CHECKING:
    from proxy.gateway.walk import Gateway

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


async def forward(gw: Gateway, ctx: RequestContext, backend: str) -> Response | None:
    """Forward to ``backend``. A Response ends the request; None means divert to another node."""
    url = gw.urls[backend] + PATHS[ctx.parsed.endpoint]
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    ttfb_deadline = min(loop.time() + gw.cfg.upstream.ttfb_timeout_s, ctx.deadline)
    resp: ClientResponse | None = None
    headers = with_credential(ctx.upstream_headers, gw.credentials[backend])
    try:
        try:
            resp = await gw.upstream.post(url, ctx.parsed.raw, headers, ttfb_deadline - loop.time())
        except UpstreamError as exc:
            _not_answered(gw, ctx, backend, exc)
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
            return await start_stream(gw, ctx, backend, resp, started, ttfb_deadline)
        return await whole_answer(gw, ctx, backend, resp, started)
    except BaseException:
        if resp is not None:
            resp.close()
        gw.release_later(ctx, backend)
        raise


def _not_answered(gw: Gateway, ctx: RequestContext, backend: str, exc: UpstreamError) -> None:
    """No response headers came: the backend timed out or could not be reached."""
    if isinstance(exc, UpstreamConnectError):
        message = f"backend {backend} could not be reached: {exc}"
    else:
        message = f"backend {backend} did not answer: {exc}"
    answer = upstream_answer(exc.failure, message)
    divert(gw, ctx, backend, answer, result=FAILURE_RESULTS[exc.failure], broken=str(exc))
