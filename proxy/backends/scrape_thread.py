"""Scrapes on a thread and event loop of their own: a busy gateway does not time out its backends.

A scrape's time limits (``collector.timeout_s``, and httpx's per-phase ones) are timers of
the loop that runs it, and a scrape takes several turns of that loop (connect, send, head,
body). On the gateway's own loop, busy with requests, a turn took 0.3-0.6 s (all-new 220 KB
prompts at 150 connections), so a scrape outlived its 1 s while the answer sat unread in
the socket: libuv runs the timers that are due before it polls for sockets. Two such rounds
in a row marked every backend down, and requests that any of them could serve failed as
503 ``no_backend_available`` (2,704 of one 10 s run's requests; the reports were 9.5 s
old when the backends went down). Here each scrape runs on a loop that does nothing else,
so the time it measures is the backend's. The scrape's own work (the request, the parse)
still takes the GIL, in slices of the interpreter's switch interval (5 ms) at worst.

What crosses between the threads: the backend's config and the report's time stamp go
in (taken on the gateway's loop: the store's clock may run tasks there), a
``ScrapeOutcome`` comes back. The thread's HTTP client is made, used and closed on its
loop only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import httpx

from proxy.backends.scrape import ScrapeOutcome, scrape, scrape_client
from proxy.config import BackendConfig, CollectorConfig
from proxy.upstream.tls import verifying_context

T = TypeVar("T")

#: How long ``close`` waits for the thread to end (a scrape in flight is cancelled first).
JOIN_TIMEOUT_S = 5.0


class ScrapeThread:
    """One daemon thread running an event loop for scrapes, started by the first scrape."""

    def __init__(self, name: str = "kvroute-scrapes") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Touched on the thread's loop only.
        self._client: httpx.AsyncClient | None = None
        self._slots = 0
        self._closing: set[asyncio.Task[None]] = set()  # old clients being closed

    async def scrape(
        self, backend: BackendConfig, cc: CollectorConfig, slots: int, taken_at: float
    ) -> ScrapeOutcome:
        """``backend``'s scrape, run on the thread; its report is stamped ``taken_at``."""
        return await self._run(self._scrape_there(backend, cc, slots, taken_at))

    async def close(self) -> None:
        """Close the client on the thread's loop, then stop the loop and the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close_there(), loop))
        finally:
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join, JOIN_TIMEOUT_S)
            if not thread.is_alive():
                loop.close()

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        # Cancelling the caller cancels the scrape on the thread's loop too.
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._started()))

    def _started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    async def _scrape_there(
        self, backend: BackendConfig, cc: CollectorConfig, slots: int, taken_at: float
    ) -> ScrapeOutcome:
        client = await self._client_for(slots, cc)
        return await scrape(client, backend, cc.timeout_s, lambda: taken_at)

    async def _client_for(self, slots: int, cc: CollectorConfig) -> httpx.AsyncClient:
        """One client for all scrapes, sized to the fleet so no scrape waits for a connection."""
        if self._client is not None and slots <= self._slots:
            return self._client
        tls = await verifying_context()
        if self._client is not None and slots <= self._slots:
            # Another scrape built it while this one waited for the context.
            return self._client
        old, self._client, self._slots = self._client, scrape_client(slots, cc, tls), slots
        if old is not None:
            closing = asyncio.get_running_loop().create_task(old.aclose())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        return self._client

    async def _close_there(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
