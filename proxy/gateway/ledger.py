"""Every reservation this gateway holds, and releases that must not be lost.

A release that fails (store down or paused) would leave the reservation in Redis until its
TTL, and a reserve that timed out may still run once a paused Redis resumes. So a failed
release is queued and retried in the background until it succeeds or the reservation would
have expired anyway; and at shutdown every reservation still held is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.breaker import CircuitBreaker

log = logging.getLogger("kvroute.reservations")


class ReservationLedger:
    def __init__(
        self,
        store: StateStore,
        breaker: CircuitBreaker,
        ttl_s: float,
        on_error: Callable[[str], None] = lambda op: None,
        retry_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.breaker = breaker
        self.ttl_s = ttl_s
        self.on_error = on_error
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self.held: dict[str, str] = {}  # reservation id -> backend
        self.pending: dict[str, tuple[str, float]] = {}  # id -> (backend, give up at)
        self._flusher: asyncio.Task[None] | None = None

    def hold(self, backend: str, rid: str) -> None:
        """Record a reservation (also one whose reserve call failed: it may still land)."""
        self.held[rid] = backend

    async def release(self, backend: str, rid: str) -> None:
        self.held.pop(rid, None)
        try:
            await self.breaker.call(lambda: self.store.release(backend, rid), "release")
        except StoreUnavailable:
            self.on_error("release")
            self.pending[rid] = (backend, self.clock() + self.ttl_s)
            self._ensure_flusher()

    def _ensure_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(
                self._flush_loop(), name="kvroute-release-retry"
            )

    async def flush(self) -> None:
        """Retry every queued release once."""
        now = self.clock()
        for rid, (backend, give_up) in list(self.pending.items()):
            if now >= give_up:
                self.pending.pop(rid, None)  # expired in the store by now
                continue
            try:
                await self.breaker.call(
                    functools.partial(self.store.release, backend, rid), "release"
                )
            except StoreUnavailable:
                return  # still down: the next round tries again
            self.pending.pop(rid, None)

    async def _flush_loop(self) -> None:
        while self.pending:
            await asyncio.sleep(self.retry_interval_s)
            try:
                await self.flush()
            except Exception:
                log.exception("retrying queued releases failed")
        log.info("every queued reservation release went through")

    async def close(self, deadline_s: float = 5.0) -> None:
        """Shutdown: release whatever is still held, flush the queue once, stop retrying."""
        for rid, backend in list(self.held.items()):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(deadline_s):
                    await self.release(backend, rid)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(deadline_s):
                await self.flush()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self.pending:
            log.warning(
                "%d reservation releases could not be sent; they expire on their own",
                len(self.pending),
            )
