"""What the answer teaches, and the one release of the request's reservation.

Envoy streams the upstream's answer through the EPP: its status at the headers, then the
body chunks (SSE included), then its end. The same lessons as the gateway's own relay
(``proxy.gateway.answers``, ``proxy.gateway.stream``) are taken here: a success for the
backend's health, the KV projection's progress and output ratio (``MemoryPressure``), the
servers' prompt count from ``usage`` (``TokenCounts``), the request's outcome and duration.

``end`` releases the reservation exactly once, however the exchange stops: the answer's
last byte, the client gone, the upstream broken, or the stream closed by the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Literal

from proxy.epp.door import Pick
from proxy.epp.failures import Booked, book_error
from proxy.gateway.walk import Gateway
from proxy.upstream.classify import json_object

Ending = Literal["answered", "closed"]
# A JSON answer is kept for learning only up to this size (a longer one is not sampled).
_WHOLE_LIMIT = 1 << 20


class Answer:
    """One placed request, from its pick to its release."""

    def __init__(self, gw: Gateway, picked: Pick) -> None:
        self.gw = gw
        self.ctx = picked.ctx
        self.backend = picked.backend
        # Where the answer came from, as the gateway reports it (the pick unless it says
        # otherwise): health and outcome are that backend's; the reservation stays the pick's.
        self.served = picked.backend
        self.status: int | None = None
        self.streamed = False
        # The last two SSE chunks (usage comes last), or a JSON answer's bytes.
        self.tail: deque[bytes] = deque(maxlen=2)
        self.whole: list[bytes] = []
        self.size = 0
        # The answer's Retry-After, for an error answer's cooldown.
        self.retry_after: str | None = None
        self.released = False
        gw.active += 1

    def headers(
        self, status: int, content_type: str, retry_after: str | None = None
    ) -> dict[str, str]:
        """The response began: the headers kvroute adds to it (as the gateway's answers carry)."""
        self.status = status
        self.retry_after = retry_after
        self.streamed = content_type.startswith("text/event-stream")
        self.ctx.backend = self.served
        return self.ctx.answer_headers(self.served)

    def chunk(self, data: bytes) -> None:
        """One body chunk on its way to the client."""
        if not data:
            return
        if self.ctx.first_event_at is None:
            self.ctx.first_event_at = asyncio.get_running_loop().time()
        if self.streamed:
            self.gw.pressure.progress(self.ctx, self.backend, data)
            self.tail.append(data)
        elif self.size + len(data) <= _WHOLE_LIMIT:
            self.whole.append(data)
        self.size += len(data)

    def end(self, how: Ending) -> None:
        """The exchange is over: learn what it showed, then release (only the first call acts)."""
        if self.released:
            return
        self.released = True
        gw, ctx = self.gw, self.ctx
        booked = Booked("client_disconnect", False)
        try:
            booked = self._learn(how)
            if ctx.counts_request:
                gw.metrics.labelled(gw.metrics.requests, ctx.cls, self.served, booked.outcome).inc()
                elapsed = time.perf_counter() - ctx.started
                gw.metrics.labelled(gw.metrics.duration, ctx.cls).observe(elapsed)
        finally:
            gw.active -= 1
            if not booked.released:
                gw.tasks.release_later(ctx, self.backend)

    def _learn(self, how: Ending) -> Booked:
        status = self.status
        if how == "closed" or status is None:
            # The stream closed before the answer ended: the client left or the upstream broke.
            return Booked("client_disconnect", False)
        gw = self.gw
        if status >= 400:
            if self.served != self.backend:
                # Served elsewhere (a retry of the gateway's): nothing booked against the pick.
                gw.metrics.labelled(gw.metrics.attempts, self.served, "server_error").inc()
                return Booked("upstream_error", False)
            body = b"".join(self.whole)
            return book_error(gw, self.ctx, self.backend, status, body, self.retry_after)
        gw.metrics.labelled(gw.metrics.attempts, self.served, "ok").inc()
        gw.health.success(self.served)
        self._usage()
        return Booked("success", False)

    def _usage(self) -> None:
        """The servers' own counts: output ratio and prompt tokens (as the gateway learns them)."""
        gw, ctx = self.gw, self.ctx
        model = ctx.parsed.model
        if self.streamed:
            gw.pressure.finished(ctx, self.backend)
            gw.token_counts.observe(model, ctx.counted_prompt_tokens, b"".join(self.tail))
            return
        if self.size > _WHOLE_LIMIT or not gw.answer_samples.take(model, time.monotonic()):
            return
        body = b"".join(self.whole)
        answer = json_object(body)
        if answer is not None:
            gw.token_counts.observe(model, ctx.counted_prompt_tokens, body)
            gw.pressure.answered(ctx, self.backend, answer)
