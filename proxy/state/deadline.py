"""A store call's deadline that does not blame Redis for the gateway's own busy event loop.

Every Redis call runs under ``StoreConfig.op_timeout_s`` (100 ms by default), and a call that
misses it, twice, makes the store "unavailable": the gateway degrades to its local view,
forgets the call's reservation (a tombstone in Redis) and drops the connection. Under a
burst of big prompts the loop can be busy for hundreds of milliseconds at a stretch (each
220 KB request parses and sizes on it): Redis answers in well under a millisecond, but the
reply waits in the socket while other requests run, and the deadline's timer, due long
before, fires first in the next turn of the loop, ahead of the socket's read. Measured on
the shared-document benchmark with a Redis store: the store was "degraded" one second after
a 3 s burst, with 295 tombstones and a connection made per dropped call.

So a deadline whose timer fires late (the loop was blocked past it) is extended once, by
its own length: the turn that reads the waiting reply comes before the extended one. A
frozen or dead Redis on a loop that runs on time still fails at the deadline (timers fire
within a millisecond there); on a lagging loop it fails after at most twice the deadline
plus the lag.

A busy loop is not only a blocked one. Under load a store call spans turns of the loop: its
reply is read in one turn's poll, and the call resumes in a later turn, whose due timers
run first (uvloop; asyncio's own loop queues them behind the read). A deadline falling due
there, on time, so not forgiven, cancelled a call whose reply was already read, and a
cancelled task drops the result it was waiting for. So the deadline, when it is finally
due, is checked again after the loop has polled its sockets and run what that poll woke
(``_AFTER_IO_HOPS`` callbacks later, a few microseconds on an idle loop): only a call still
unanswered then is cancelled.

Pure asyncio: no Redis here (``proxy.state.redis_store`` uses it).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

#: A timer firing later than this (or a quarter of the deadline, if smaller) means the loop
#: was blocked: timers of a loop that runs on time fire within a millisecond.
LATE_S = 0.01
#: ``call_soon`` hops from a due timer to a point after the loop's next socket poll and the
#: callbacks it queued. uvloop runs timers, then the ready callbacks (those queued while they
#: run wait for the next turn), then polls; asyncio's own loop polls, then runs timers and
#: callbacks. Three hops pass one poll and its wake-ups on both.
_AFTER_IO_HOPS = 3


class lag_tolerant_timeout:
    """``asyncio.timeout(delay)``, forgiving the event loop's own lateness once.

    A plain class, like ``proxy.core.digest.memo``: it is entered on every store call.
    """

    __slots__ = ("_delay", "_handle", "_inner", "_loop", "_when", "forgiven")

    _handle: asyncio.TimerHandle | asyncio.Handle

    def __init__(self, delay: float) -> None:
        self._delay = delay
        #: The deadline was extended once because its timer fired late.
        self.forgiven = False

    async def __aenter__(self) -> lag_tolerant_timeout:
        self._loop = asyncio.get_running_loop()
        self._inner = asyncio.timeout(None)
        await self._inner.__aenter__()
        self._when = self._loop.time() + self._delay
        self._handle = self._loop.call_at(self._when, self._expire)
        return self

    @property
    def when(self) -> float:
        """The loop time the deadline falls due (moved on once if forgiven)."""
        return self._when

    def _expire(self) -> None:
        now = self._loop.time()
        if not self.forgiven and now - self._when > min(LATE_S, self._delay / 4):
            self.forgiven = True
            self._when = now + self._delay
            self._handle = self._loop.call_at(self._when, self._expire)
            return
        self._after_io(_AFTER_IO_HOPS)

    def _after_io(self, hops: int) -> None:
        """Cancel the call once the loop has read its sockets: unless it ends first (its
        ``__aexit__`` cancels this handle)."""
        if hops > 0:
            self._handle = self._loop.call_soon(self._after_io, hops - 1)
            return
        # asyncio's own timeout: cancels the task, and raises TimeoutError from the block.
        self._inner.reschedule(self._loop.time())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._handle.cancel()
        await self._inner.__aexit__(exc_type, exc, tb)
