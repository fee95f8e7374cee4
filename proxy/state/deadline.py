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

Pure asyncio: no Redis here (``proxy.state.redis_store`` uses it).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

#: A timer firing later than this (or a quarter of the deadline, if smaller) means the loop
#: was blocked: timers of a loop that runs on time fire within a millisecond.
LATE_S = 0.01


class lag_tolerant_timeout:
    """``asyncio.timeout(delay)``, forgiving the event loop's own lateness once.

    A plain class, like ``proxy.core.digest.memo``: it is entered on every store call.
    """

    __slots__ = ("_delay", "_handle", "_inner", "_loop", "_when", "forgiven")

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

    def _expire(self) -> None:
        now = self._loop.time()
        if not self.forgiven and now - self._when > min(LATE_S, self._delay / 4):
            self.forgiven = True
            self._when = now + self._delay
            self._handle = self._loop.call_at(self._when, self._expire)
            return
        self._inner.reschedule(now)  # asyncio's own timeout: cancels, and raises TimeoutError

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._handle.cancel()
        await self._inner.__aexit__(exc_type, exc, tb)
