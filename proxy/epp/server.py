"""The EPP's two gRPC servers (ext_proc and health), started inside the gateway app.

They run on the app's own event loop (``grpc.aio``), after every component of the gateway
started (``attach`` wraps the app's lifespan) and stop before any of them stops: a stream
still open at shutdown gets ``grace_s`` to finish, then is cancelled and releases its
reservation like any stream that ends. One port per server, as the reference EPP has them:
9002 for ext_proc, 9003 for health.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc
from starlette.applications import Starlette

from proxy.config import Config
from proxy.epp import health
from proxy.epp.bodiless import Bodiless
from proxy.epp.endpoints import Endpoints
from proxy.epp.exchange import Exchange
from proxy.epp.guard import EppGuard
from proxy.gateway.walk import Gateway
from proxy.tasks import PeriodicTask

log = logging.getLogger("kvroute.epp")
#: How often readiness follows the gateway's shutdown (its drain flag is set in a signal
#: handler, which may not call into the loop).
READINESS_CHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class EppOptions:
    """Where the EPP listens (port 0: any free port, read back from ``EppServer.ports``)."""

    host: str = "0.0.0.0"
    port: int = 9002
    health_port: int = 9003
    grace_s: float = 30.0


class Processor:
    """``envoy.service.ext_proc.v3.ExternalProcessor``: one ``Exchange`` per stream."""

    def __init__(self, gateway: Callable[[], Gateway]) -> None:
        self.gateway = gateway
        self.guard: EppGuard | None = None
        self.bodiless = Bodiless()
        self._endpoints: tuple[Config, Endpoints] | None = None

    def endpoints(self, cfg: Config) -> Endpoints:
        """The address map of the config in force (rebuilt when discovery changes it)."""
        if self._endpoints is None or self._endpoints[0] is not cfg:
            self._endpoints = (cfg, Endpoints(cfg))
        return self._endpoints[1]

    async def Process(self, request_iterator: Any, context: Any) -> None:
        gw = self.gateway()
        if self.guard is None:
            self.guard = EppGuard(gw.cfg)
        await Exchange(gw, self.endpoints(gw.cfg), self.guard, self.bodiless).run(context)


class EppServer:
    """Both servers, started and stopped together."""

    def __init__(self, options: EppOptions) -> None:
        self.options = options
        self.ports: tuple[int, int] = (0, 0)
        self._servers: list[grpc.aio.Server] = []
        self._health = health.servicer()
        self._unready = False
        self._watch: PeriodicTask | None = None

    async def start(
        self, gateway: Callable[[], Gateway], draining: Callable[[], bool] = lambda: False
    ) -> None:
        """Serve; ``draining``: the gateway's shutdown began (readiness then turns down at
        once, while open streams still run)."""
        await self._listen(gateway)
        self._watch = PeriodicTask(
            "kvroute-epp-readiness",
            lambda: self._follow(draining),
            READINESS_CHECK_S,
            keep_going=lambda: not self._unready,
        )
        self._watch.start()

    async def _follow(self, draining: Callable[[], bool]) -> None:
        if draining() and not self._unready:
            self._unready = True
            await self._health.enter_graceful_shutdown()

    async def _listen(self, gateway: Callable[[], Gateway]) -> None:
        opts = self.options
        processing = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Processor(gateway), processing)
        port = processing.add_insecure_port(f"{opts.host}:{opts.port}")
        checks = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, checks)
        health_port = checks.add_insecure_port(f"{opts.host}:{opts.health_port}")
        await health.alive(self._health)
        await checks.start()
        await processing.start()
        self._servers = [processing, checks]
        self.ports = (port, health_port)
        await health.ready(self._health, True)
        log.info(
            "endpoint picker: ext_proc on %s:%d, health on %s:%d",
            opts.host,
            port,
            opts.host,
            health_port,
        )

    async def stop(self) -> None:
        """Not ready first, then the streams in flight get ``grace_s``; health goes last."""
        if self._watch is not None:
            await self._watch.stop()
            self._watch = None
        self._unready = True
        await self._health.enter_graceful_shutdown()
        for server in self._servers:
            await server.stop(self.options.grace_s)
        self._servers = []


def attach(app: Starlette, options: EppOptions) -> EppServer:
    """Run the EPP inside ``app``'s lifespan, over the gateway its components build."""
    inner = app.router.lifespan_context
    server = EppServer(options)

    @contextlib.asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[None]:
        async with inner(a):
            drain = getattr(a.state, "drain", None)
            draining = (lambda: bool(drain.draining)) if drain is not None else (lambda: False)
            await server.start(lambda: a.state.rt.gateway, draining)
            try:
                yield
            finally:
                await server.stop()

    app.router.lifespan_context = lifespan
    return server
