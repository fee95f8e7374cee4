"""Serve a simulated engine: one aiohttp app on a port, in a test's loop or as a process.

``AppServer`` is the one wrapper both engine kinds use (this module's ``EngineServer``, the
vLLM/SGLang/TGI ``BehaviourServer``); ``serve_until_stopped`` runs one until SIGINT or
SIGTERM. The model is ``loadtest.engine.model``, the HTTP surface ``loadtest.engine.handlers``,
the command line ``loadtest.engine.cli``. It imports neither the command line nor the
behaviours, which both import it (``loadtest.engine.server`` gathers the names for callers).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal

from aiohttp import web

from loadtest.engine.handlers import ENGINE_KEY, Engine, build_app
from loadtest.engine.model import EngineConfig
from proxy.core.tokens import encoding


class AppServer:
    """One aiohttp app on ``host``; ``port=0`` picks a free port."""

    def __init__(self, app: web.Application, host: str, port: int, backlog: int = 128) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.backlog = backlog
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> int:
        # Load the tokenizer now (about a second), not on the first request.
        await asyncio.to_thread(encoding)
        self.runner = web.AppRunner(
            # Cancel a handler whose client went away, so its request frees its memory.
            self.app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1.0,
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, backlog=self.backlog)
        await site.start()
        addrs = self.runner.addresses
        self.port = int(addrs[0][1]) if addrs else self.port
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class EngineServer(AppServer):
    """Start/stop one engine on the running loop; ``port=0`` picks a free port."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(build_app(config), config.host, config.port, backlog=1024)
        self.config = config

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    async def stop(self) -> None:
        if self.runner is not None:
            self.engine.set_fault("none")  # let hung requests go
        await super().stop()


async def serve_until_stopped(server: AppServer, ready: str | None) -> None:
    """Start ``server``, print ``ready`` (with its URL), and serve until SIGINT/SIGTERM."""
    try:
        await server.start()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # One line and a non-zero exit, not a traceback: the usual cause is a second engine.
        raise SystemExit(
            f"kvroute engine: port {server.port} is in use on {server.host}; pick another with --port"
        ) from None
    if ready is not None:
        print(f"{ready} listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


async def serve(config: EngineConfig, ready_line: bool = True) -> None:
    """Serve until SIGINT/SIGTERM; prints one 'listening on URL' line (tests read the port from it)."""
    ready = f"kvroute engine (name: {config.name})" if ready_line else None
    await serve_until_stopped(EngineServer(config), ready)


def run(config: EngineConfig) -> None:
    """Run one engine in this process until interrupted (uvloop when available and enabled)."""
    if config.uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency of uvicorn[standard]
            pass
        else:
            uvloop.run(serve(config))
            return
    asyncio.run(serve(config))
