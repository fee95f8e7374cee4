"""Step 6 for streams: wait for the first event, then relay; always clean up once.

Until the first event arrives nothing has reached the client, so a stream that stalls,
breaks or is not server-sent events can still divert. After it, a break is continued on
another backend where it may be (``proxy.gateway.continuation``); otherwise the stream ends
with a final SSE error event that names the cause (idle gap, total time, broken off, or the
gateway's drain time over at shutdown, which is never continued). Whatever happens, each
upstream connection is closed (the backend sees the cancel) or returned to the pool, and
each reservation released, exactly once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from starlette.responses import Response

from proxy.core.stream_transcript import Rewrite, Transcript
from proxy.errors import BodyTimeout, UpstreamBroken, sse_error_event
from proxy.gateway.answers import AnswerPorts
from proxy.gateway.context import RequestContext, RequestResult
from proxy.gateway.continuation_metrics import BreakCause
from proxy.gateway.continuation_rules import break_cause, stall_timeout, transcript_for
from proxy.gateway.first_event import first_event
from proxy.gateway.live_streams import LiveStreams
from proxy.gateway.relay import OnceCallback, RelayResponse
from proxy.upstream.client import UpstreamAnswer, next_chunk, response_headers

log = logging.getLogger("kvroute.gateway")


class StreamPorts(AnswerPorts, Protocol):
    """What relaying uses: the answer ports, the register of live streams (a shutdown ends
    them), and the continuation of a broken stream (``proxy.gateway.continuation``, reached
    through this port: the continuation drives a relay, so the relay does not import it)."""

    live_streams: LiveStreams

    def carry_on(self, relay: StreamRelay, broken: Break) -> AsyncIterator[bytes]:
        """What the client gets after ``broken``: continuations where allowed, else the final event."""
        ...


async def start_stream(
    gw: StreamPorts,
    ctx: RequestContext,
    backend: str,
    resp: UpstreamAnswer,
    started: float,
    ttfb_deadline: float,
) -> Response | None:
    """Wait for the first event before answering: until then a failure can still go to another backend."""
    first = await first_event(gw, ctx, backend, resp, ttfb_deadline)
    if first is None:
        return None
    ctx.backend = backend
    relay = StreamRelay(gw, ctx, backend, resp, started)
    relay.transcript = transcript_for(ctx, backend)
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


@dataclass(frozen=True, slots=True)
class Break:
    """How a stream broke after its first byte, and the final event today's gateway sends."""

    cause: BreakCause
    message: str
    final_event: bytes


class StreamRelay:
    """One stream being relayed; ``outcome`` is how it ended (until it ends: the client left).

    ``transcript`` (set when the stream may be continued, ``proxy.gateway.continuation``)
    reads what the client received; ``backend``/``resp`` are the part being relayed now, and
    ``holds`` whether its reservation is still to be released.
    """

    def __init__(
        self,
        gw: StreamPorts,
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
        # The last two chunks: the final usage chunk (the server's prompt count) is in them.
        self.tail: tuple[bytes, bytes] = (b"", b"")
        self.transcript: Transcript | None = None
        self.holds = True
        self.broken: Break | None = None
        # The request was counted already (a continuation's placement gave the final answer).
        self.counted = False
        # Set by interrupt() when a shutdown's drain time is over (proxy.gateway.live_streams).
        self.interrupted = False
        gw.live_streams.add(self)

    def interrupt(self) -> None:
        """End the stream now with the shutdown event: wake the pending read with an error."""
        self.interrupted = True
        self.resp.content.set_exception(ConnectionAbortedError("the gateway is shutting down"))

    async def body(self, first: bytes, on_close: OnceCallback) -> AsyncIterator[bytes]:
        """Relay the stream; a failure after the first byte is continued elsewhere where it
        may be, else it ends the stream with an SSE error event."""
        try:
            async for piece in self.relay_part(first):
                yield piece
            if self.broken is not None:
                async for piece in self.gw.carry_on(self, self.broken):
                    yield piece
        finally:
            await on_close()

    async def relay_part(
        self, first: bytes, rewrite: Rewrite | None = None
    ) -> AsyncIterator[bytes]:
        """Relay ``self.resp`` to its end; a break is left in ``self.broken``, nothing yielded for
        it. A shutdown's interrupt ends the stream with its own event (never continued)."""
        backend, transcript = self.backend, self.transcript
        idle = stall_timeout(self.ctx, transcript is not None)
        self.broken = None
        # The last two chunks as the server sent them: its final usage chunk is in them.
        self.tail = (b"", first)
        try:
            pressure = self.gw.pressure
            chunk = first
            while chunk:
                # Progress for the KV projection: tokens this stream has carried so far.
                pressure.progress(self.ctx, backend, chunk)
                out = chunk if transcript is None else transcript.feed(chunk, rewrite)
                if out:
                    yield out
                if self.interrupted:
                    yield self.shutdown_event()
                    return
                if transcript is not None and transcript.error is not None:
                    raise UpstreamBroken(f"error event: {transcript.error}")
                chunk = await next_chunk(self.resp, idle, self.ctx.deadline)
                if chunk:
                    self.tail = (self.tail[1], chunk)
            if transcript is not None and not (transcript.done or transcript.complete):
                raise UpstreamBroken("the stream ended before its last event")
            # The body's end, even if interrupt() came just after it: the stream is whole.
            self._ended_whole(rewrite is None)
        except BodyTimeout as exc:
            self.broken = self._timed_out(exc)
        except UpstreamBroken as exc:
            if self.interrupted:
                # The break is ours (interrupt()), not the backend's: no health failure.
                yield self.shutdown_event()
                return
            self.broken = self._broke_off(exc)

    def _ended_whole(self, first_part: bool) -> None:
        """The part reached its last event: a success for the backend and the KV projection."""
        self.outcome = "success"
        self.gw.pressure.finished(self.ctx, self.backend)
        self.gw.health.success(self.backend)
        if first_part:
            # The server's count of the prompt the gateway sized (not a continuation's).
            self.gw.token_counts.observe(
                self.ctx.parsed.model, self.ctx.counted_prompt_tokens, b"".join(self.tail)
            )

    def _timed_out(self, exc: BodyTimeout) -> Break:
        """The stream went silent too long (idle: the backend's fault) or ran out of total time."""
        backend = self.backend
        self.outcome = "upstream_timeout"
        if exc.phase == "idle":
            self.gw.health.failure(backend)
        log.warning(
            "request %s: stream from %s timed out (%s)", self.ctx.request_id, backend, exc.phase
        )
        event = sse_error_event(f"backend {backend}: {exc}", code=f"upstream_{exc.phase}_timeout")
        return Break("stall" if exc.phase == "idle" else "total_timeout", str(exc), event)

    def _broke_off(self, exc: UpstreamBroken) -> Break:
        """The backend broke the stream off, or sent its own error event."""
        backend, transcript = self.backend, self.transcript
        self.outcome = "upstream_error"
        self.gw.health.failure(backend)
        log.warning(
            "request %s: stream from %s broke off: %s", self.ctx.request_id, backend, exc.cause
        )
        if transcript is not None and transcript.error is not None:
            # The backend's own error event, as it would have reached the client.
            return Break("error_event", transcript.error, transcript.final_error_event())
        event = sse_error_event(
            f"backend {backend} stopped streaming ({exc.cause})", code="upstream_stream_broken"
        )
        return Break(break_cause(exc.cause), exc.cause, event)

    def drop_part(self) -> None:
        """The part being relayed broke: drop its connection and free its reservation, once."""
        self.resp.close()
        if self.holds:
            self.holds = False
            self.gw.tasks.release_later(self.ctx, self.backend)

    def shutdown_event(self) -> bytes:
        """The last event of a stream the gateway's shutdown cut (not the backend's fault)."""
        self.outcome = "shutdown"
        log.warning(
            "request %s: stream from %s ended: the gateway's drain time is over",
            self.ctx.request_id,
            self.backend,
        )
        return sse_error_event(
            "the gateway is shutting down and its drain time is over; retry the request",
            type="server_error",
            code="gateway_shutting_down",
        )

    async def close(self) -> None:
        """Return or drop the upstream connection, count the request, release the reservation."""
        if self.outcome != "success":
            # Drops the upstream connection: the backend sees the cancel.
            self.resp.close()
        else:
            self.resp.release()
        cls = self.ctx.cls
        metrics = self.gw.metrics
        if not self.counted:
            metrics.labelled(metrics.requests, cls, self.backend, self.outcome).inc()
        metrics.labelled(metrics.duration, cls).observe(time.perf_counter() - self.started)
        self.gw.live_streams.discard(self)
        if self.holds:
            self.holds = False
            self.gw.tasks.release_later(self.ctx, self.backend)
