"""Start and stop one simulated vLLM / SGLang / TGI server (in a test or as a process)."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from aiohttp import web

from loadtest.engine.behaviours.app import FRONT_KEY, BehaviourConfig, Front, build_app
from proxy.core.tokens import encoding


class BehaviourServer:
    """One server on ``host``; ``port=0`` picks a free port."""

    def __init__(self, config: BehaviourConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.app = build_app(config)
        self._runner: web.AppRunner | None = None

    @property
    def front(self) -> Front:
        return self.app[FRONT_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> int:
        # Load the tokenizer now, not on the first request.
        await asyncio.to_thread(encoding)
        self._runner = web.AppRunner(
            # Cancel a handler whose client went away, so its request frees its blocks.
            self.app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addrs = self._runner.addresses
        self.port = int(addrs[0][1]) if addrs else self.port
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def serve(config: BehaviourConfig, host: str, port: int) -> None:
    server = BehaviourServer(config, host, port)
    await server.start()
    print(
        f"kvroute engine {config.name} ({config.behaviour}) listening on {server.url}", flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run(config: BehaviourConfig, host: str, port: int) -> None:
    asyncio.run(serve(config, host, port))
