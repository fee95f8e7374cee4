"""Shutdown that keeps its promise: one drain time, then a clean end for what is left.

uvicorn alone stops accepting on SIGTERM, waits ``timeout_graceful_shutdown`` for requests in
flight, then cancels their tasks: a stream still running simply loses its connection, which a
client cannot tell from a broken backend. kvroute's server wraps that sequence:

1. the signal marks the gateway as draining: ``GET /ready`` answers 503 from that moment, on
   any connection still open (Kubernetes' preStop sleep has already taken the pod out of the
   Service's endpoints; the 503 keeps any other balancer from sending more);
2. uvicorn stops accepting and lets requests in flight run, for ``shutdown.drain_s``
   (default 600 s, the same as ``upstream.total_timeout_s``: a stream that the gateway
   would let run to its end is not cut by a rollout);
3. at the drain time, every stream still relayed ends with a final SSE error event (code
   ``gateway_shutting_down``) and its reservation is released; uvicorn cancels what is
   left (a non-streamed request cannot carry an event) ``CLOSE_GRACE_S`` later.

The orchestrator's own grace must cover all of it: deploy/ sets Kubernetes'
``terminationGracePeriodSeconds`` and Compose's ``stop_grace_period`` from the same number.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from types import FrameType

import orjson
import uvicorn
from starlette.requests import Request
from starlette.responses import Response

from proxy.api.eager_accept import EagerAccept, accepts_eagerly
from proxy.gateway.live_streams import LiveStreams

log = logging.getLogger("kvroute.app")

#: After the drain time, how long streams get to write their last event before uvicorn
#: cancels every task still running.
CLOSE_GRACE_S = 5.0


class Drain:
    """The gateway's shutdown state: read by ``/ready``, driven by ``DrainingServer``."""

    def __init__(self, drain_s: Callable[[], float] = lambda: 600.0) -> None:
        self.draining = False
        self.began_at: float | None = None
        # The running config's drain time (a reload may change it) unless the CLI fixed it.
        self.drain_s = drain_s
        # Set when the gateway is built (the lifespan): its live streams.
        self.streams = LiveStreams()

    def begin(self) -> None:
        """Called from a signal handler: set flags only (no logging, no loop calls)."""
        if not self.draining:
            self.draining = True
            self.began_at = time.monotonic()

    def expire(self) -> int:
        """The drain time is over: end every stream still relayed; returns how many."""
        n = self.streams.interrupt_all()
        if n:
            log.warning(
                "shutdown: drain time (%gs) over; ending %d stream%s with a final error event",
                self.drain_s(),
                n,
                "" if n == 1 else "s",
            )
        return n


class DrainingServer(uvicorn.Server):
    """uvicorn's server with kvroute's shutdown sequence (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.acceptors: list[EagerAccept] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        # libuv accepts one connection per turn of the loop: accept the rest ourselves.
        loop = asyncio.get_running_loop()
        self.acceptors = [
            EagerAccept(loop, sock, self._protocol)
            for sock in sockets or []
            if accepts_eagerly(sock)
        ]

    def _protocol(self) -> asyncio.Protocol:
        """What uvicorn's own ``create_protocol`` builds for a connection it accepts."""
        protocol: asyncio.Protocol = self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )
        return protocol

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.drain.begin()
        super().handle_exit(sig, frame)
        # uvicorn >= 0.29 raises the signal again once it has stopped, so the process dies
        # of it (exit status -15). A finished drain is a clean stop: exit 0 instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.begin()
        for acceptor in self.acceptors:
            acceptor.close()
        drain_s = self.drain.drain_s()
        assert self.drain.began_at is not None
        left = max(0.0, drain_s - (time.monotonic() - self.drain.began_at))
        log.info(
            "shutdown: not accepting; /ready answers 503; %d stream%s in flight may run %gs more",
            len(self.drain.streams),
            "" if len(self.drain.streams) == 1 else "s",
            left,
        )
        self.config.timeout_graceful_shutdown = int(left + CLOSE_GRACE_S) + 1
        timer = asyncio.get_running_loop().call_later(left, self.drain.expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


async def ready(request: Request) -> Response:
    """``GET /ready``: 503 from the moment a shutdown begins, else 200.

    Readiness says "send me traffic", not "the fleet is healthy" (that is ``/health``): with
    every backend down, a gateway that answers "all backends down" (503, named) beats a
    Service with no endpoints (connection refused), and all replicas would fail together.
    """
    drain: Drain = request.app.state.drain
    if drain.draining:
        body, status = {"status": "draining"}, 503
    else:
        body, status = {"status": "ready"}, 200
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
