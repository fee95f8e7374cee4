"""RetryBudget.acquire_within: a waiter gets the slot a release frees; only a final refusal counts."""

from __future__ import annotations

import asyncio

from proxy.gateway.retry_budget import RetryBudget


def test_a_release_hands_the_slot_to_a_waiter() -> None:
    async def scenario() -> tuple[bool, int, int]:
        budget = RetryBudget(percent=0, min_concurrency=1)
        assert budget.try_acquire(0)
        waiter = asyncio.create_task(budget.acquire_within(lambda: 0, 30.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        budget.release()
        got = await waiter
        return got, budget.in_flight, budget.exhausted_total

    assert asyncio.run(scenario()) == (True, 1, 0)


def test_no_slot_in_time_is_one_refusal() -> None:
    async def scenario() -> tuple[bool, int]:
        budget = RetryBudget(percent=0, min_concurrency=1)
        assert budget.try_acquire(0)
        got = await budget.acquire_within(lambda: 0, 0.05)
        return got, budget.exhausted_total

    assert asyncio.run(scenario()) == (False, 1)
