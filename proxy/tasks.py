"""Background loops, written once: start, a round every interval, and a stop that cannot hang.

The collector, the maintenance loop, the active health checks and the reservation ledger's
release retries each run one of these; a loop of another shape (discovery's watch with its
backoff) stops through ``stop_task``.

Why the stop is more than ``task.cancel(); await task``: timeout helpers in libraries below
us (HTTP, Redis) can turn a cancellation that races their own deadline into their timeout
error and swallow it; the loop then runs on and a bare await never returns (seen in the
collector). So ``stop()`` sets a flag that ends the loop at its next turn whatever happened
to the cancellation, repeats the cancellation until the task is done, and gives up (logged)
after a bounded wait rather than hang the shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("kvroute.tasks")


def _log_error(name: str) -> Callable[[Exception], None]:
    def log_it(exc: Exception) -> None:
        log.error("%s: round failed", name, exc_info=exc)

    return log_it


class PeriodicTask:
    """Run ``body`` every ``interval_s`` until stopped (or until ``keep_going`` says no).

    Rounds keep a fixed rate: a slow round is followed at once by the next one, without a
    burst of rounds to catch up. An exception in a round is passed to ``on_error`` (by
    default: logged) and the loop goes on; the loop must outlive anything a round does.
    ``wait_first`` sleeps one interval before the first round (a retry loop); ``keep_going``
    is asked before each round, and the loop ends by itself when it answers False (``start``
    runs it again later).
    """

    def __init__(
        self,
        name: str,
        body: Callable[[], Awaitable[object]],
        interval_s: float | Callable[[], float],
        *,
        on_error: Callable[[Exception], None] | None = None,
        wait_first: bool = False,
        keep_going: Callable[[], bool] = lambda: True,
        stop_timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self._body = body
        self._interval = interval_s if callable(interval_s) else (lambda: interval_s)
        self._on_error = on_error or _log_error(name)
        self._wait_first = wait_first
        self._keep_going = keep_going
        self.stop_timeout_s = stop_timeout_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop (on the running event loop); nothing happens while it already runs."""
        if self.running:
            return
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not self._stopping:
            if self._wait_first:
                next_at = await self._pause(loop, next_at)
            if self._stopping or not self._keep_going():
                return
            try:
                await self._body()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._on_error(exc)
            if not self._wait_first:
                next_at = await self._pause(loop, next_at)

    async def _pause(self, loop: asyncio.AbstractEventLoop, next_at: float) -> float:
        """Sleep until the next round is due; returns when that is."""
        next_at += self._interval()
        now = loop.time()
        if next_at < now:
            # Fell behind (a slow round): start again from now, no burst.
            next_at = now
        await asyncio.sleep(next_at - now)
        return next_at

    async def stop(self, timeout_s: float | None = None) -> bool:
        """End the loop and wait for it, bounded: True once it ended, False if left behind."""
        task, self._task = self._task, None
        if task is None:
            return True
        self._stopping = True
        limit = self.stop_timeout_s if timeout_s is None else timeout_s
        return await stop_task(task, self.name, limit)


async def stop_task(task: asyncio.Task[None], name: str, timeout_s: float) -> bool:
    """Cancel ``task`` until it is done, bounded: True once it ended, False if left behind.

    For a loop that also checks a stop flag of its own (set before calling this): the flag
    ends it even when a library below turned the cancellation into its own error.
    """
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=max(0.0, min(0.2, give_up_at - loop.time())))
        if not task.done() and loop.time() >= give_up_at:
            log.error("%s: the loop did not stop within %gs; leaving it behind", name, timeout_s)
            return False
    if not task.cancelled() and task.exception() is not None:
        log.error("%s: the loop had failed", name, exc_info=task.exception())
    return True
