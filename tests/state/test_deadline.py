"""A store call's deadline forgives the event loop's own lateness once, and a reply the loop
has already read; nothing else."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.state.deadline import lag_tolerant_timeout


def hold_the_loop(seconds: float) -> None:
    """The gateway's own work on the loop (a big prompt's parse and sizing): no await."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def reply_after(delay_s: float, deadline_s: float, block_s: float) -> tuple[str, bool]:
    """A call whose reply is ready after ``delay_s``, with the loop blocked ``block_s`` at its start."""
    loop = asyncio.get_running_loop()

    async def call() -> tuple[str, bool]:
        fut: asyncio.Future[str] = loop.create_future()
        loop.call_later(delay_s, fut.set_result, "reply")
        async with lag_tolerant_timeout(deadline_s) as t:
            return await fut, t.forgiven

    task = asyncio.ensure_future(call())
    await asyncio.sleep(0)  # the call starts: its timer and its reply are scheduled
    hold_the_loop(block_s)  # the gateway's own work holds the loop past both
    return await task


async def test_a_reply_waiting_behind_a_blocked_loop_is_not_a_timeout() -> None:
    assert await reply_after(0.005, 0.05, 0.2) == ("reply", True)


async def test_plain_asyncio_timeout_fails_the_same_call() -> None:
    # What the store did before: the late timer runs first and cancels a call already answered.
    loop = asyncio.get_running_loop()

    async def call() -> str:
        fut: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.005, fut.set_result, "reply")
        async with asyncio.timeout(0.05):
            return await fut

    task = asyncio.ensure_future(call())
    await asyncio.sleep(0)
    hold_the_loop(0.2)
    with pytest.raises(TimeoutError):
        await task


async def test_no_reply_on_a_loop_that_runs_on_time_fails_at_the_deadline() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await reply_after(10.0, 0.05, 0.0)
    assert time.monotonic() - started < 1.0


async def test_no_reply_on_a_blocked_loop_fails_after_one_extension() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await reply_after(10.0, 0.05, 0.2)
    assert 0.2 <= time.monotonic() - started < 1.0


async def test_a_quick_reply_passes_untouched() -> None:
    assert await reply_after(0.001, 0.5, 0.0) == ("reply", False)


async def test_a_reply_read_as_the_deadline_falls_due_is_not_a_timeout() -> None:
    """The busy loop's case: the deadline's timer fires on time, in the turn that also brings
    the reply (here a timer due at the same moment, queued after it). Cancelling there would
    drop a reply already in hand; the deadline waits for what the loop has read."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str] = loop.create_future()
    async with lag_tolerant_timeout(0.05) as t:
        # Its one forgiveness spent: however late a loaded machine runs the timer, it is due.
        t.forgiven = True
        loop.call_at(t.when, fut.set_result, "reply")
        assert await fut == "reply"


async def test_plain_asyncio_timeout_drops_that_reply() -> None:
    # The premise: asyncio's own timeout cancels the call the same reply would have ended.
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str] = loop.create_future()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05) as plain:
            when = plain.when()
            assert when is not None
            loop.call_at(when, lambda: fut.done() or fut.set_result("reply"))
            await fut
    assert fut.cancelled()  # the call was cancelled first: the reply had nowhere to go
