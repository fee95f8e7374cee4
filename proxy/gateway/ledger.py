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
from proxy.tasks import PeriodicTask

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
        # Runs only while releases are queued: started by a failed release, ends when none is left.
        self._retries = PeriodicTask(
            "kvroute-release-retry",
            self.flush,
            retry_interval_s,
            wait_first=True,
            keep_going=self._still_pending,
        )

    def hold(self, backend: str, reservation_id: str) -> None:
        """Record a reservation (also one whose reserve call failed: it may still land)."""
        self.held[reservation_id] = backend

    async def release(self, backend: str, reservation_id: str) -> None:
        self.held.pop(reservation_id, None)
        try:
            await self.breaker.call(lambda: self.store.release(backend, reservation_id), "release")
        except StoreUnavailable:
            self.on_error("release")
            self.pending[reservation_id] = (backend, self.clock() + self.ttl_s)
            self._retries.start()

    async def flush(self) -> None:
        """Retry every queued release once."""
        now = self.clock()
        for reservation_id, (backend, give_up) in list(self.pending.items()):
            if now >= give_up:
                self.pending.pop(reservation_id, None)  # expired in the store by now
                continue
            try:
                await self.breaker.call(
                    functools.partial(self.store.release, backend, reservation_id), "release"
                )
            except StoreUnavailable:
                return  # still down: the next round tries again
            self.pending.pop(reservation_id, None)

    def _still_pending(self) -> bool:
        if self.pending:
            return True
        log.info("every queued reservation release went through")
        return False

    async def close(self, deadline_s: float = 5.0) -> None:
        """Shutdown: release whatever is still held, flush the queue once, stop retrying."""
        for reservation_id, backend in list(self.held.items()):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(deadline_s):
                    await self.release(backend, reservation_id)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(deadline_s):
                await self.flush()
        await self._retries.stop()
        if self.pending:
            log.warning(
                "%d reservation releases could not be sent; they expire on their own",
                len(self.pending),
            )
