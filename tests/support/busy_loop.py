"""A gateway loop that runs late: every turn spends ``turn_s`` of CPU, for ``for_s`` seconds.

What a busy gateway looks like to timers on its loop (0.3-0.6 s turns were measured with
all-new 220 KB prompts at 150 connections); tests make the turns longer than the limit under
test, so a limit timed by this loop's timers would run out while the answer waits in the socket.
"""

from __future__ import annotations

import asyncio
import time


def busy_turns(turn_s: float, for_s: float) -> None:
    """From the next turn on, hold the running loop ``turn_s`` per turn until ``for_s`` pass."""
    loop = asyncio.get_running_loop()
    until = time.perf_counter() + for_s

    def turn() -> None:
        turn_ends = time.perf_counter() + turn_s
        while time.perf_counter() < turn_ends:
            pass
        if time.perf_counter() < until:
            loop.call_soon(turn)

    loop.call_soon(turn)
