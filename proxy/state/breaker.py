"""A circuit breaker for the state store on the request path.

Each store call already has a short deadline and one retry (proxy.state.redis_store), but
with Redis paused (SIGSTOP) every request would still spend that deadline on every call.
After ``failures`` consecutive failures the circuit opens: calls fail at once with
StoreUnavailable (the request path then runs degraded) for ``open_s``; then exactly one
call is let through as a probe, and its success closes the circuit again.

With degraded mode (proxy.state.degraded) the store runs the breaker itself around each
Redis call (``guard``) and answers locally when it is open; it marks the breaker
``delegated``, and the request path's ``call`` then passes straight through to the store,
so the circuit's state and counters still describe Redis and nothing is counted twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from proxy.state.base import StoreUnavailable

T = TypeVar("T")
State = Literal["closed", "open", "half_open"]


class CircuitOpen(StoreUnavailable):
    """The breaker refused the call: it never reached the store (nothing there to undo)."""


class CircuitBreaker:
    def __init__(
        self, failures: int, open_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = failures
        self.open_s = open_s
        self.clock = clock
        self.state: State = "closed"
        self.failures = 0
        self.opened_total = 0
        self.rejected_total = 0
        self._opened_at = 0.0
        self._probing = False
        self.delegated = False
        self.on_change: list[Callable[[State], None]] = []

    def _set(self, state: State) -> None:
        if state != self.state:
            self.state = state
            for cb in self.on_change:
                cb(state)

    def allow(self) -> bool:
        """May a call go to the store now? (In half-open state: only the one probe.)"""
        if self.state == "closed":
            return True
        if self.state == "open":
            if self.clock() - self._opened_at < self.open_s:
                return False
            self._set("half_open")
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self.failures = 0
        self._probing = False
        self._set("closed")

    def failure(self) -> None:
        self.failures += 1
        self._probing = False
        if self.state == "half_open" or self.failures >= self.threshold:
            if self.state != "open":
                self.opened_total += 1
            self._opened_at = self.clock()
            self._set("open")

    def call(self, fn: Callable[[], Awaitable[T]], what: str = "store") -> Awaitable[T]:
        """Run one store call through the breaker; StoreUnavailable at once while open.

        Not itself a coroutine: it hands back ``guard``'s (or, delegated, the call's own),
        so a store call awaits one coroutine of the breaker's, not two (every request makes
        at least one; profiled at ~1% of a tiny request's CPU).
        """
        if self.delegated:
            return fn()
        return self.guard(fn, what)

    async def guard(self, fn: Callable[[], Awaitable[T]], what: str = "store") -> T:
        """The breaker proper, whether delegated or not."""
        if not self.allow():
            self.rejected_total += 1
            raise CircuitOpen(f"{what}: circuit open (store failed {self.failures} times in a row)")
        try:
            result = await fn()
        except StoreUnavailable:
            self.failure()
            raise
        except (asyncio.CancelledError, Exception):
            # A cancelled or broken probe must not wedge the breaker half-open.
            self._probing = False
            raise
        self.success()
        return result
