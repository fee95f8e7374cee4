"""The one helper for work a request leaves behind: releases, store bookkeeping, its tasks.

Steps never start a task of their own: what must not delay the answer (a reservation's
release when the store is slow, a learned ceiling written to the store) goes through
``spawn``, and ``drain`` at shutdown waits for all of it, so no release is lost to an exit.
Store calls on the request path go through the circuit breaker here, counted once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import Counter

from proxy.gateway.admission import Admission
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.local_view import LocalReservations
from proxy.gateway.memory_pressure import MemoryPressure
from proxy.state.base import StoreUnavailable
from proxy.state.breaker import CircuitBreaker

if TYPE_CHECKING:
    from proxy.gateway.context import RequestContext

T = TypeVar("T")


class Background:
    """Background work and guarded store calls, shared by every step of every request."""

    def __init__(
        self,
        ledger: ReservationLedger,
        local: LocalReservations,
        pressure: MemoryPressure,
        breaker: CircuitBreaker,
        store_errors: Counter,
        admission: Admission,
    ) -> None:
        self.ledger = ledger
        self.admission = admission
        self.local = local
        self.pressure = pressure
        self.breaker = breaker
        self.store_errors = store_errors
        self._running: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run store bookkeeping off the answer's path; ``drain()`` waits for it."""
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def release_later(self, ctx: RequestContext, backend: str) -> None:
        """Free this request's reservation on ``backend`` (the ledger retries a failed release)."""
        self.local.remove(backend, ctx.reservation_id)
        self.pressure.ended(ctx, backend)
        if not self.ledger.release_at_once(backend, ctx.reservation_id):
            self.spawn(self.ledger.release(backend, ctx.reservation_id))
        self.admission.freed()

    async def drain(self) -> None:
        """Wait for every task spawned so far (shutdown)."""
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    async def store_call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """A store call on the request path: through the breaker; StoreUnavailable counted and re-raised."""
        try:
            return await self.breaker.call(fn, op)
        except StoreUnavailable:
            self.store_errors.labels(op).inc()
            raise

    async def store_quietly(self, op: str, fn: Callable[[], Awaitable[None]]) -> None:
        """A store call whose failure only costs an optimisation (counted, not raised)."""
        try:
            await self.store_call(op, fn)
        except StoreUnavailable:
            pass
