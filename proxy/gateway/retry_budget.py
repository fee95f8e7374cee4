"""A retry budget: retries of failed attempts cannot multiply an overload.

As Envoy's retry budgets: at any moment at most ``max(min_concurrency, percent x active
requests)`` retries may be in flight. When a backend falls over under load, every request
on it would otherwise be retried at once onto the remaining backends; the budget lets a
share through and answers the rest with the original error. Diverting an allocation
failure to another node is the gateway's routing, not a retry of a failure, and is bounded
by ``retry.max_attempts`` instead.
"""

from __future__ import annotations

import math


class RetryBudget:
    def __init__(self, percent: float, min_concurrency: int) -> None:
        self.percent = percent
        self.min_concurrency = min_concurrency
        self.in_flight = 0
        self.granted_total = 0
        self.exhausted_total = 0

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
