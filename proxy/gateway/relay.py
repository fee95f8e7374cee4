"""A streaming response that always cleans up, even if the client left before the first chunk.

Starlette cancels a streaming response when the client disconnects. If that happens before
the body generator was first iterated, the generator's own ``finally`` never runs; the
upstream connection and the reservation would leak until their timeouts. This response
runs its ``on_close`` callback exactly once, whatever happens.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class OnceCallback:
    """Wraps an async cleanup so that several paths may call it and it runs once."""

    def __init__(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._fn = fn
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        await self._fn()


class RelayResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterable[bytes],
        on_close: OnceCallback,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()
