"""A bounded waiting room for requests that fit nowhere right now.

A long request that finds no block big enough waits here (up to the configured time)
instead of failing at once: blocks free up as requests finish, and the next report shows
it. Bounded so that a burst cannot pile up unbounded memory and latency.
"""

from __future__ import annotations

import asyncio
import contextlib


class Admission:
    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.depth = 0
        self._changed = asyncio.Event()

    def try_enter(self) -> bool:
        if self.depth >= self.max_size:
            return False
        self.depth += 1
        return True

    def leave(self) -> None:
        self.depth = max(0, self.depth - 1)

    def notify(self) -> None:
        """Wake every waiter: fresh reports arrived or memory was released."""
        self._changed.set()
        self._changed = asyncio.Event()

    def freed(self) -> None:
        """A request ended here: the room it held is free now, so a held request is
        released on that event, not on the next poll or report (nothing to do, and no
        Event made, when nobody waits: this runs once per request)."""
        if self.depth:
            self.notify()

    async def wait(self, timeout_s: float) -> None:
        """Sleep until notified or the timeout passes, whichever is first."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()
