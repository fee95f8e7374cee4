"""A streaming response that always cleans up, even if the client left before the first chunk.

Starlette cancels a streaming response when the client disconnects. If that happens before
the body generator was first iterated, the generator's own ``finally`` never runs; the
upstream connection and the reservation would leak until their timeouts. This response
runs its ``on_close`` callback exactly once, whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.gateway.client_watch import ClientWatch

log = logging.getLogger("kvroute.gateway")
T = TypeVar("T")

# Seconds past the request's deadline that a blocked write to the client may still take.
WRITE_GRACE_S = 2.0


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
    """A relayed stream bounded by the request's deadline, on the write side too.

    Reads from the backend stop at ``deadline`` (``next_chunk``), but a client that stops
    reading blocks the *write* instead, holding the upstream connection, the reservation
    and a concurrency slot. So the whole response is cut ``WRITE_GRACE_S`` after the
    deadline (the grace lets the final SSE error event out to a client that still reads).
    """

    def __init__(
        self,
        content: AsyncIterable[bytes],
        on_close: OnceCallback,
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
        deadline: float | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, headers=headers, media_type=media_type)
        self.on_close = on_close
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._bounded(self._stream(scope, receive, send))

    async def relay_to(self, receive: Receive, write: Callable[[bytes], Awaitable[None]]) -> bool:
        """The stream's chunks to ``write``, not through ASGI (the server's lean path).

        The same bounds as ``__call__``: the deadline (writes included), a ``ClientWatch``
        on ``receive`` that stops the relay when the client leaves, ``on_close`` once.
        True when the stream ran to its end (the caller then ends the response).
        """
        return await self._bounded(self._pump(receive, write)) is True

    async def _pump(self, receive: Receive, write: Callable[[bytes], Awaitable[None]]) -> bool:
        async with ClientWatch(receive) as watch:
            async for chunk in self.body_iterator:
                if chunk:
                    await write(
                        chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk)
                    )
        return not watch.gone

    async def _bounded(self, work: Coroutine[Any, Any, T]) -> T | None:
        """``work`` cut ``WRITE_GRACE_S`` past the deadline; ``on_close`` whatever happens."""
        try:
            if self.deadline is None:
                return await work
            try:
                async with asyncio.timeout_at(self.deadline + WRITE_GRACE_S):
                    return await work
            except TimeoutError:
                # Returning unfinished makes the server close the client's connection.
                log.warning("stream cut: the client stopped reading past the total time limit")
                return None
        finally:
            work.close()
            await self.on_close()

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Starlette's streaming, without its task group where the server predates ASGI 2.4.

        Before spec 2.4 (uvicorn says 2.3) a server's ``send`` does not fail once the client
        has gone, so Starlette streams in an anyio task group raced against a disconnect
        listener: a task group and two tasks per stream. Here the stream runs in the
        request's own task under a ``ClientWatch``: the same cancel when the client leaves,
        and a task only for a stream that lasts past ``WATCH_AFTER_S``.
        """
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        if tuple(map(int, spec.split("."))) >= (2, 4):
            # send() raises once the client is gone: Starlette needs no listener.
            await super().__call__(scope, receive, send)
            return
        async with ClientWatch(receive):
            await self.stream_response(send)
        if self.background is not None:
            await self.background()
