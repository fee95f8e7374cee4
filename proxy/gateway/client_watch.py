"""Watch the client while an attempt runs in the request's own task; cancel it if the client leaves.

The attempt used to run in a task of its own, raced against a watcher with ``asyncio.wait``:
two tasks and a wait per request. Here the attempt runs in the request's task and only the
watcher is a task; when the client disconnects, the watcher cancels the request's task, and
leaving the ``with`` turns that cancellation back into ``watch.gone`` (the way
``asyncio.timeout`` turns its own cancellation into ``TimeoutError``). A cancellation from
anywhere else (server shutdown) still propagates.

The watcher starts only once the attempt has run ``WATCH_AFTER_S``: most tiny answers come
sooner and need no watcher at all, and a client that leaves is noticed at most that much
later (a generation takes far longer, and the backend still sees the cancel). The watches
of one loop wait in one line (``DueWatches``) behind one timer: a timer armed and cancelled
per request was 3.5% of the gateway's CPU on tiny requests (docs/benchmarks.md, section 9).
"""

from __future__ import annotations

import asyncio
import weakref
from types import TracebackType

from starlette.types import Receive

# How long an attempt runs before the client is watched (seconds).
WATCH_AFTER_S = 0.05


async def client_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read already, so nothing else comes)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:
        # This server cannot tell: never report the client gone.
        await asyncio.get_running_loop().create_future()


class DueWatches:
    """The watches entered on one loop and not yet started, in the order they are due.

    One timer, at the first one's time, starts every watch that is due by then; watches are
    entered in time order, so that is a walk from the front of the line.
    """

    __slots__ = ("loop", "pending", "timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: the line is the value of a weak mapping keyed by its loop.
        self.loop = weakref.proxy(loop)
        self.pending: dict[ClientWatch, float] = {}
        self.timer: asyncio.TimerHandle | None = None

    def add(self, watch: ClientWatch) -> None:
        due = self.loop.time() + WATCH_AFTER_S
        self.pending[watch] = due
        if self.timer is None:
            self.timer = self.loop.call_at(due, self._start_due)

    def discard(self, watch: ClientWatch) -> None:
        self.pending.pop(watch, None)

    def _start_due(self) -> None:
        self.timer = None
        # A timer may fire a little before its time (the loop's clock resolution).
        now = self.loop.time() + 0.001
        pending = self.pending
        while pending:
            watch, due = next(iter(pending.items()))
            if due > now:
                self.timer = self.loop.call_at(due, self._start_due)
                return
            del pending[watch]
            watch._start()


_lines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DueWatches] = (
    weakref.WeakKeyDictionary()
)
# The loop and line used last: a gateway runs one loop, so the weak mapping is rarely read.
_last: tuple[asyncio.AbstractEventLoop, DueWatches] | None = None


def due_watches() -> DueWatches:
    """The running loop's line of watches."""
    global _last
    loop = asyncio.get_running_loop()
    last = _last
    if last is not None and last[0] is loop:
        return last[1]
    line = _lines.get(loop)
    if line is None:
        line = _lines[loop] = DueWatches(loop)
    _last = (loop, line)
    return line


class ClientWatch:
    """``with ClientWatch(receive) as watch``: the block is cancelled if the client goes.

    ``receive``: the request's ASGI receive, its body already read.
    """

    __slots__ = ("_armed", "_line", "_receive", "_task", "_watcher", "gone")

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[object] | None = None
        self._line: DueWatches | None = None
        self._watcher: asyncio.Task[None] | None = None
        # Only while the block runs: a disconnect noticed after it must not cancel what follows.
        self._armed = False
        self.gone = False

    # A plain ``with`` (the attempt's): entering and leaving never wait, so no coroutine per
    # request for either; ``async with`` (the relay's) does the same.
    def __enter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._line = line = due_watches()
        line.add(self)
        self._armed = True
        return self

    def _start(self) -> None:
        if self._armed:
            self._watcher = asyncio.ensure_future(client_gone(self._receive))
            self._watcher.add_done_callback(self._on_gone)

    def _on_gone(self, watcher: asyncio.Task[None]) -> None:
        if self._armed and not watcher.cancelled() and self._task is not None:
            self.gone = True
            self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._armed = False
        if self._line is not None:
            self._line.discard(self)
        if self._watcher is not None:
            self._watcher.cancel()
        if not self.gone or self._task is None:
            return False
        # Our cancel is spent: take it back. Suppress the CancelledError only when no one
        # else cancelled the task too.
        others = self._task.uncancel()
        return exc_type is asyncio.CancelledError and others == 0

    async def __aenter__(self) -> ClientWatch:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return self.__exit__(exc_type, exc, tb)
