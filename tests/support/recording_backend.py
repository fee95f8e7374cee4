"""A backend that answers every chat completion with a fixed reply and records each request's headers.

For tests of what the gateway sends upstream (credentials, hop-by-hop headers): a real
aiohttp server on 127.0.0.1 in its own thread, so blocking clients and the openai client work.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from aiohttp import web

from tests.support.threaded_app import ThreadedApp

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


class RecordingBackend(ThreadedApp):
    def __init__(self) -> None:
        super().__init__()
        self.headers: list[dict[str, str]] = []

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
        self.serve(app)
        return self


@pytest.fixture
def recording_backend() -> Iterator[RecordingBackend]:
    backend = RecordingBackend().start()
    yield backend
    backend.stop()
