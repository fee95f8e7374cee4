"""Step 6 of the walk: one attempt on one backend, from sending the request to an answer.

The attempt either ends the request (an answer or a stream for the client) or diverts
(``None``): the reservation is freed and placement tries the next candidate. The send itself
(``proxy.gateway.send``) is shared with a stream's continuation; what this step adds is the
watch on the client.

Until the answer starts, the client is watched: if it goes away, the attempt is cancelled at
once (the upstream connection is dropped, so the backend sees the cancel) and the reservation
released, rather than holding both until the backend finishes.
"""

from __future__ import annotations

import logging
from typing import Protocol

from starlette.responses import Response

from proxy.gateway.client_watch import ClientWatch
from proxy.gateway.context import RequestContext
from proxy.gateway.send import SendPorts, send_attempt
from proxy.gateway.stream import StreamPorts, start_stream

log = logging.getLogger("kvroute.gateway")


class AttemptPorts(SendPorts, StreamPorts, Protocol):
    """What one attempt uses: sending, and relaying a stream."""


async def forward(gw: AttemptPorts, ctx: RequestContext, backend: str) -> Response | None:
    """Forward to ``backend``. A Response ends the request; None means divert to another node."""
    # A client that leaves cancels the attempt at once: its cleanup drops the upstream
    # connection and frees the reservation.
    with ClientWatch(ctx.request.receive):
        return await send_attempt(gw, ctx, backend, start_stream)
    # Reached only when the watch suppressed its own cancellation: the client went away.
    return _client_left(gw, ctx, backend)


def _client_left(gw: AttemptPorts, ctx: RequestContext, backend: str) -> Response:
    log.info("request %s: the client went away while %s worked on it", ctx.request_id, backend)
    gw.metrics.requests.labels(ctx.cls, backend, "client_disconnect").inc()
    # Nobody reads it: the connection is gone.
    return Response(status_code=499)
