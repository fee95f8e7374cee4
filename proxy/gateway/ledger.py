"""Every reservation this gateway holds, and releases that must not be lost.

A release that fails (store down or paused) would leave the reservation in Redis until its
TTL, and a reserve that timed out may still run once a paused Redis resumes. So a failed
release is queued and retried in the background until it succeeds or the reservation would
have expired anyway; and at shutdown every reservation still held is released.

After the store was unreachable (a Redis restart, a Sentinel failover) the store may not know
what this gateway has placed: requests placed in degraded mode have no reservation, and
reservations acknowledged by a master that died before replicating them are gone. Those
requests still hold memory on their nodes, and until a report taken after they allocated
reaches the store, the fit check would not see them. So before its next reservation the
gateway re-asserts every reservation it holds (same id, tokens, creation time and expiry;
no fit check): the store counts them as pending against any older report again, and no node
is over-committed once the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.breaker import CircuitBreaker

log = logging.getLogger("kvroute.reservations")


class ReservationLedger:
    def __init__(
        self,
        store: StateStore,
        breaker: CircuitBreaker,
        ttl_s: float,
        on_error: Callable[[str], None] = lambda op: None,
        retry_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.breaker = breaker
        self.ttl_s = ttl_s
        self.on_error = on_error
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self.held: dict[str, str] = {}  # reservation id -> backend
        self.claims: dict[str, tuple[int, float]] = {}  # reservation id -> (tokens, created at)
        # Set when the store failed us: it may be missing some of what we hold.
        self.unsure = False
        self.reasserted = 0
        self._reasserting = asyncio.Lock()
        self.pending: dict[str, tuple[str, float]] = {}  # id -> (backend, give up at)
        self._flusher: asyncio.Task[None] | None = None

    def hold(self, backend: str, rid: str, tokens: int = 0, created_at: float = 0.0) -> None:
        """Record a reservation (also one whose reserve call failed: it may still land)."""
        self.held[rid] = backend
        if tokens > 0:
            self.claims[rid] = (tokens, created_at)

    def mark_unsure(self) -> None:
        """The store failed a call: re-assert what we hold once it answers again."""
        self.unsure = True

    async def reassert(self, chunk: int = 32) -> None:
        """Write every held reservation again if the store may have lost some (see above).

        Cheap when nothing failed (one flag test). Fails quietly while the store is still down
        (the breaker answers at once) and tries again before the next reservation.
        """
        if not self.unsure:
            return
        async with self._reasserting:
            if not self.unsure:
                return
            todo = [
                (rid, b, *self.claims[rid]) for rid, b in self.held.items() if rid in self.claims
            ]
            try:
                for i in range(0, len(todo), chunk):
                    await asyncio.gather(*(self._reassert_one(*t) for t in todo[i : i + chunk]))
            except StoreUnavailable:
                self.on_error("reassert")
                return
            self.unsure = False
            self.reasserted += len(todo)
            if todo:
                log.info("re-asserted %d reservations after a store outage", len(todo))

    async def _reassert_one(self, rid: str, backend: str, tokens: int, created_at: float) -> None:
        if self.held.get(rid) != backend:
            return  # released meanwhile
        await self.breaker.call(
            functools.partial(
                self.store.reserve, backend, rid, tokens, created_at, self.ttl_s, check_fit=False
            ),
            "reserve",
        )

    async def release(self, backend: str, rid: str) -> None:
        self.held.pop(rid, None)
        self.claims.pop(rid, None)
        try:
            await self.breaker.call(lambda: self.store.release(backend, rid), "release")
        except StoreUnavailable:
            self.on_error("release")
            self.mark_unsure()
            self.pending[rid] = (backend, self.clock() + self.ttl_s)
            self._ensure_flusher()

    def _ensure_flusher(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(
                self._flush_loop(), name="kvroute-release-retry"
            )

    async def flush(self) -> None:
        """Retry every queued release once."""
        now = self.clock()
        for rid, (backend, give_up) in list(self.pending.items()):
            if now >= give_up:
                self.pending.pop(rid, None)  # expired in the store by now
                continue
            try:
                await self.breaker.call(
                    functools.partial(self.store.release, backend, rid), "release"
                )
            except StoreUnavailable:
                return  # still down: the next round tries again
            self.pending.pop(rid, None)

    async def _flush_loop(self) -> None:
        while self.pending:
            await asyncio.sleep(self.retry_interval_s)
            try:
                await self.flush()
            except Exception:
                log.exception("retrying queued releases failed")
        log.info("every queued reservation release went through")

    async def close(self, deadline_s: float = 5.0) -> None:
        """Shutdown: release whatever is still held, flush the queue once, stop retrying."""
        for rid, backend in list(self.held.items()):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(deadline_s):
                    await self.release(backend, rid)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(deadline_s):
                await self.flush()
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self.pending:
            log.warning(
                "%d reservation releases could not be sent; they expire on their own",
                len(self.pending),
            )
