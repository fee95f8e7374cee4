"""An aiohttp application served on 127.0.0.1 from a thread of its own.

The small HTTP backends of the tests (fault modes, header recording) subclass it: blocking
clients, the openai client and a gateway in another thread all reach it as a real server.
"""

from __future__ import annotations

import asyncio
import threading
import time

from aiohttp import web


class ThreadedApp:
    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self, app: web.Application) -> None:
        """Serve ``app`` on a free port; returns once it accepts connections."""
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=main, daemon=True).start()
        assert ready.wait(10)

    def stop(self) -> None:
        """Close the server and cancel what its handlers still run (a stream, a sleep)."""
        if not self._loop.is_running():
            return

        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        deadline = time.monotonic() + 10
        while self._loop.is_running() and time.monotonic() < deadline:
            time.sleep(0.01)
