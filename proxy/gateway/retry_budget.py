"""A retry budget: retries of failed attempts cannot multiply an overload.

As Envoy's retry budgets: at any moment at most ``max(min_concurrency, percent x active
requests)`` retries may be in flight. When a backend falls over under load, every request
on it would otherwise be retried at once onto the remaining backends; the budget lets a
share through and answers the rest with the original error. Diverting an allocation
failure to another node is the gateway's routing, not a retry of a failure, and is bounded
by ``retry.max_attempts`` instead.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from proxy.gateway.metrics import GatewayMetrics

if TYPE_CHECKING:
    from proxy.gateway.context import RequestContext


class RetryBudget:
    def __init__(self, percent: float, min_concurrency: int) -> None:
        self.percent = percent
        self.min_concurrency = min_concurrency
        self.in_flight = 0
        self.granted_total = 0
        self.exhausted_total = 0
        # Set (and replaced) at each release, for ``acquire_within``'s waiters.
        self._freed: asyncio.Event | None = None

    def limit(self, active_requests: int) -> int:
        return max(self.min_concurrency, math.floor(self.percent / 100.0 * max(0, active_requests)))

    def try_acquire(self, active_requests: int) -> bool:
        """Take one retry slot; False (and counted) when the budget is spent."""
        if self.in_flight >= self.limit(active_requests):
            self.exhausted_total += 1
            return False
        self.in_flight += 1
        self.granted_total += 1
        return True

    def release(self, n: int = 1) -> None:
        self.in_flight = max(0, self.in_flight - n)
        if n > 0 and self._freed is not None:
            self._freed.set()
            self._freed = None

    async def acquire_within(self, active: Callable[[], int], timeout_s: float) -> bool:
        """``try_acquire``, waiting up to ``timeout_s`` for a slot to free; only a final
        refusal counts as exhaustion. For work that must not be dropped for being one of
        many at once (the streams of a backend that died), yet stays within the cap."""
        if self.percent <= 0 and self.min_concurrency <= 0:
            return self.try_acquire(active())  # retries are off: no slot will ever free
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while self.in_flight >= self.limit(active()) and (left := until - loop.time()) > 0:
            if self._freed is None:
                self._freed = asyncio.Event()
            freed = self._freed
            # Re-checked at least every 0.1 s: new requests raise the limit without a release.
            try:
                await asyncio.wait_for(freed.wait(), min(left, 0.1))
            except TimeoutError:
                pass
        return self.try_acquire(active())


class RetryPorts(Protocol):
    """What taking a retry slot uses: the budget, the replica's active requests, the counters."""

    budget: RetryBudget
    active: int
    metrics: GatewayMetrics


async def retry_slot(gw: RetryPorts, ctx: RequestContext) -> bool:
    """A retry-budget slot for a retry of a failed attempt, waited for within ``queue.max_wait_s``.

    The budget caps retries in flight (each holds its slot until its answer starts). When a
    backend dies, every request it held fails at once: the streams it was answering (their
    continuations) and the ones it had queued before their first byte (their retries).
    Refusing the ones over the cap at once lost requests that another backend could serve
    (section 11 of docs/benchmarks.md; likely also the 2 of 240 that the KV-events
    benchmark's engine restart once lost). Waiting a moment keeps the cap and
    loses nothing: slots free within a first-event time. Only the final refusal counts as
    budget exhaustion; a budget of zero refuses at once.
    """
    wait_s = min(ctx.cfg.queue.max_wait_s, ctx.deadline - asyncio.get_running_loop().time())
    if not await gw.budget.acquire_within(lambda: gw.active, wait_s):
        gw.metrics.retries.labels("budget_exhausted").inc()
        return False
    ctx.retries += 1
    return True
