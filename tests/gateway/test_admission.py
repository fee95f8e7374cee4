"""The admission queue (proxy/gateway/admission.py): bounded, woken by news, never stuck."""

from __future__ import annotations

import asyncio
import time

from proxy.gateway.admission import Admission


def test_the_waiting_room_is_bounded() -> None:
    room = Admission(max_size=2)
    assert room.try_enter() and room.try_enter()
    assert not room.try_enter()
    assert room.depth == 2
    room.leave()
    assert room.try_enter()
    room.leave()
    room.leave()
    room.leave()
    assert room.depth == 0  # an extra leave never goes below zero


def test_a_room_of_size_zero_admits_nobody() -> None:
    assert not Admission(max_size=0).try_enter()


async def test_notify_wakes_every_waiter_at_once() -> None:
    room = Admission(max_size=4)
    started = time.monotonic()
    waiters = [asyncio.create_task(room.wait(30.0)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiters)
    room.notify()
    await asyncio.wait_for(asyncio.gather(*waiters), timeout=5.0)
    # 30 s was the timeout: woken by the notify, far sooner.
    assert time.monotonic() - started < 6.0


async def test_wait_returns_at_its_timeout_without_news() -> None:
    room = Admission(max_size=1)
    started = time.monotonic()
    await asyncio.wait_for(room.wait(0.05), timeout=5.0)
    assert time.monotonic() - started >= 0.04


async def test_a_notify_before_waiting_does_not_leak_into_the_next_wait() -> None:
    room = Admission(max_size=1)
    room.notify()
    started = time.monotonic()
    await room.wait(0.05)
    assert time.monotonic() - started >= 0.04


async def test_a_request_ending_wakes_the_held_ones_not_an_empty_room() -> None:
    """``freed`` (every request's end: ``Background.release_later``) releases a held request
    on that event; with nobody held it does nothing (it runs once per request)."""
    room = Admission(max_size=2)
    event = room._changed
    room.freed()
    assert room._changed is event  # nobody waits: no wake, no new Event
    assert room.try_enter()
    waiter = asyncio.create_task(room.wait(30.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    room.freed()
    await asyncio.wait_for(waiter, timeout=5.0)
