"""A backend that answers every chat completion with a fixed reply and records each request's headers.

For tests of what the gateway sends upstream (credentials, hop-by-hop headers): a real
aiohttp server on 127.0.0.1 in its own thread, so blocking clients and the openai client work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

REPLY = {
    "id": "c1",
    "object": "chat.completion",
    "model": "m",
    "created": 0,
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


class RecordingBackend:
    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def last(self) -> dict[str, str]:
        """The last request's headers, names lowercased."""
        return {k.lower(): v for k, v in self.headers[-1].items()}

    async def _chat(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        await request.read()
        return web.json_response(REPLY)

    def start(self) -> RecordingBackend:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
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
        return self

    def stop(self) -> None:
        async def down() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(down(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def recording_backend() -> Iterator[RecordingBackend]:
    backend = RecordingBackend().start()
    yield backend
    backend.stop()
