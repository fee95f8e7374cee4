"""Step 6 for streams: wait for the first event, then relay; always clean up once.

Until the first event arrives nothing has reached the client, so a stream that stalls,
breaks or is not server-sent events can still divert. After it, a failure cannot be
retried: the stream ends with a final SSE error event that names the cause (idle gap, total
time, broken off). Whatever happens, the upstream connection is closed (the backend sees the
cancel) or returned to the pool, and the reservation released, exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.responses import Response

from proxy.errors import BodyTimeout, UpstreamBroken, sse_error_event
from proxy.gateway.answers import broken_answer
from proxy.gateway.context import RequestContext, RequestResult
from proxy.gateway.relay import OnceCallback, RelayResponse
from proxy.upstream.classify import looks_like_sse
from proxy.upstream.client import UpstreamAnswer, next_chunk, response_headers

if TYPE_CHECKING:
    from proxy.gateway.walk import Gateway

log = logging.getLogger("kvroute.gateway")


async def start_stream(
    gw: Gateway,
    ctx: RequestContext,
    backend: str,
    resp: UpstreamAnswer,
    started: float,
    ttfb_deadline: float,
) -> Response | None:
    """Wait for the first event before answering: until then a failure can still go to another backend."""
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
    ctx.backend = backend
    relay = StreamRelay(gw, ctx, backend, resp, started)
    # RelayResponse runs close() even if the client left before the first chunk was pulled
    # (then the generator never starts and its own finally would never run).
    on_close = OnceCallback(relay.close)
    return RelayResponse(
        relay.body(first, on_close),
        on_close,
        status_code=resp.status,
        headers=ctx.answer_headers(backend, response_headers(resp.headers)),
        media_type=resp.headers.get("content-type", "text/event-stream"),
        deadline=ctx.deadline,
    )


class StreamRelay:
    """One stream being relayed; ``outcome`` is how it ended (until it ends: the client left)."""

    def __init__(
        self,
        gw: Gateway,
        ctx: RequestContext,
        backend: str,
        resp: UpstreamAnswer,
        started: float,
    ) -> None:
        self.gw = gw
        self.ctx = ctx
        self.backend = backend
        self.resp = resp
        self.started = started
        self.outcome: RequestResult = "client_disconnect"

    async def body(self, first: bytes, on_close: OnceCallback) -> AsyncIterator[bytes]:
        """Relay the stream; a failure after the first byte ends it with an SSE error event."""
        backend, health = self.backend, self.gw.health
        idle = self.ctx.cfg.upstream.idle_timeout_s
        try:
            pressure = self.gw.pressure
            pressure.progress(self.ctx, backend, first)
            yield first
            while chunk := await next_chunk(self.resp, idle, self.ctx.deadline):
                pressure.progress(self.ctx, backend, chunk)
                yield chunk
            self.outcome = "success"
            pressure.finished(self.ctx, backend)
            health.success(backend)
        except BodyTimeout as exc:
            self.outcome = "upstream_timeout"
            if exc.phase == "idle":
                health.failure(backend)
            log.warning(
                "request %s: stream from %s timed out (%s)", self.ctx.request_id, backend, exc.phase
            )
            yield sse_error_event(f"backend {backend}: {exc}", code=f"upstream_{exc.phase}_timeout")
        except UpstreamBroken as exc:
            self.outcome = "upstream_error"
            health.failure(backend)
            log.warning(
                "request %s: stream from %s broke off: %s", self.ctx.request_id, backend, exc.cause
            )
            yield sse_error_event(
                f"backend {backend} stopped streaming ({exc.cause})",
                code="upstream_stream_broken",
            )
        finally:
            await on_close()

    async def close(self) -> None:
        """Return or drop the upstream connection, count the request, release the reservation."""
        if self.outcome != "success":
            # Drops the upstream connection: the backend sees the cancel.
            self.resp.close()
        else:
            self.resp.release()
        cls = self.ctx.cls
        metrics = self.gw.metrics
        metrics.labelled(metrics.requests, cls, self.backend, self.outcome).inc()
        metrics.labelled(metrics.duration, cls).observe(time.perf_counter() - self.started)
        self.gw.release_later(self.ctx, self.backend)
