"""PeriodicTask (proxy/tasks.py): rounds, errors, a self-ending retry loop, and a stop that cannot hang."""

from __future__ import annotations

import asyncio

from proxy.tasks import PeriodicTask


async def test_runs_rounds_until_stopped() -> None:
    rounds = 0

    async def body() -> None:
        nonlocal rounds
        rounds += 1

    task = PeriodicTask("t", body, 0.01)
    task.start()
    task.start()  # a second start while running changes nothing
    await asyncio.sleep(0.2)
    assert task.running
    assert await task.stop() is True
    assert not task.running
    seen = rounds
    assert seen >= 3
    await asyncio.sleep(0.1)
    assert rounds == seen  # really stopped


async def test_a_failing_round_is_reported_and_the_loop_goes_on() -> None:
    errors: list[Exception] = []
    rounds = 0

    async def body() -> None:
        nonlocal rounds
        rounds += 1
        raise RuntimeError(f"round {rounds}")

    task = PeriodicTask("t", body, 0.01, on_error=errors.append)
    task.start()
    await asyncio.sleep(0.2)
    await task.stop()
    assert len(errors) >= 3
    assert str(errors[0]) == "round 1"


async def test_wait_first_and_keep_going_end_the_loop_by_itself() -> None:
    pending = [1, 2]

    async def body() -> None:
        pending.pop()

    task = PeriodicTask("t", body, 0.01, wait_first=True, keep_going=lambda: bool(pending))
    task.start()
    # The first round waits one interval.
    assert len(pending) == 2
    for _ in range(200):
        if not task.running:
            break
        await asyncio.sleep(0.01)
    assert pending == [] and not task.running
    # Started again once there is work.
    pending.append(3)
    task.start()
    assert task.running
    await asyncio.sleep(0.2)
    assert pending == []
    assert await task.stop() is True


async def test_stop_ends_a_loop_whose_round_swallowed_the_cancellation() -> None:
    """A library timeout racing the cancel turns it into its own error: the flag still ends the loop."""
    entered = asyncio.Event()
    swallowed = 0

    async def body() -> None:
        nonlocal swallowed
        entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            swallowed += 1
            raise TimeoutError("the library's own timeout") from None

    task = PeriodicTask("t", body, 0.01, on_error=lambda exc: None)
    task.start()
    await entered.wait()
    assert await asyncio.wait_for(task.stop(), timeout=5.0) is True
    assert swallowed == 1 and not task.running


async def test_stop_gives_up_on_a_loop_that_never_ends_instead_of_hanging() -> None:
    """Cancel-then-await would hang here forever; stop() returns False after its bound."""
    entered = asyncio.Event()
    release = asyncio.Event()

    async def body() -> None:
        entered.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue  # ignores every cancellation

    task = PeriodicTask("t", body, 0.01, stop_timeout_s=0.2)
    task.start()
    await entered.wait()
    leftover = task._task
    # 25x the bound: a stop that hangs fails here instead of blocking the suite.
    assert await asyncio.wait_for(task.stop(), timeout=5.0) is False
    assert leftover is not None and not leftover.done()
    release.set()
    await asyncio.wait_for(asyncio.shield(leftover), timeout=5.0)
