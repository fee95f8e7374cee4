"""Every reservation this gateway holds, and releases that must not be lost.

A release that fails (store down or paused) would leave the reservation in Redis until its
TTL, and a reserve that timed out may still run once a paused Redis resumes. So a failed
release is queued and retried in the background until it succeeds or the reservation would
have expired anyway; and at shutdown every reservation still held is released.

Entries are keyed by (reservation id, backend): the gateway reuses one id across a
request's attempts, and keyed by id alone a failed attempt's release popped the retry's
entry (measured: 9,011 tokens held for 897 s). A reserve that never reached the store (the
breaker was open) needs no release, so none is queued for it. ``reserve()`` runs the
store call itself so that a request cancelled while its reserve is in flight still settles
whatever that call may reserve: with a ``forget``, whose marker also refuses the reserve
should it reach the store only later (no task per reserve to shield the call: measured on
Redis, issue 12).

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
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.breaker import CircuitBreaker, CircuitOpen
from proxy.state.memory import InProcessStore, result_now
from proxy.tasks import PeriodicTask

log = logging.getLogger("kvroute.reservations")


Key = tuple[str, str]  # (reservation id, backend)


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
        self.held: dict[Key, bool] = {}  # reservations that are (or may be) in the store
        self.unsent: set[Key] = set()  # reserves the breaker stopped: nothing to release
        self.unsure: set[Key] = set()  # reserves that timed out once sent: release with forget
        self.pending: dict[Key, float] = {}  # releases to retry -> give up at
        self.claims: dict[Key, tuple[int, float]] = {}  # -> (tokens, created at), to re-assert
        # Set when the store failed us: it may be missing some of what we hold.
        self.store_may_have_lost = False
        self.reasserted = 0
        self._reasserting = asyncio.Lock()
        self._reasserting_keys: set[Key] = set()
        # Runs only while releases are queued: started by a failed release, ends when none is left.
        self._retries = PeriodicTask(
            "kvroute-release-retry",
            self.flush,
            retry_interval_s,
            wait_first=True,
            keep_going=self._still_pending,
        )
        self._bg: set[asyncio.Task[object]] = set()
        # Releases queued for the next batch (release_at_once on a shared store).
        self._batch: list[Key] = []
        # The embedded store's calls never suspend nor fail (no I/O): its release is done
        # before returning, no task per request (release_at_once). Exactly that class: a
        # subclass may wait inside its calls.
        self._calls_never_suspend = type(store) is InProcessStore

    def hold(
        self,
        backend: str,
        reservation_id: str,
        *,
        sent: bool = True,
        tokens: int = 0,
        created_at: float = 0.0,
    ) -> None:
        """Record a reservation (also one whose reserve call failed: it may still land).

        ``sent=False``: the reserve never reached the store (breaker open), so its release
        is a no-op rather than a queued retry. ``tokens``/``created_at``: what to re-assert
        after a store outage.
        """
        key = (reservation_id, backend)
        if tokens > 0:
            self.claims[key] = (tokens, created_at)
        if sent:
            self.held[key] = True
            self.unsent.discard(key)
        else:
            self.unsent.add(key)

    def mark_unsure(self) -> None:
        """The store failed a call: re-assert what we hold once it answers again."""
        self.store_may_have_lost = True

    async def reassert(self, chunk: int = 32) -> None:
        """Write every held reservation again if the store may have lost some (see above).

        Cheap when nothing failed (one flag test). Fails quietly while the store is still down
        (the breaker answers at once) and tries again before the next reservation.
        """
        if not self.store_may_have_lost:
            return
        async with self._reasserting:
            if not self.store_may_have_lost:
                return
            todo = [(key, *self.claims[key]) for key in self.claims if key in self.held]
            try:
                for i in range(0, len(todo), chunk):
                    await asyncio.gather(*(self._reassert_one(*t) for t in todo[i : i + chunk]))
            except StoreUnavailable:
                self.on_error("reassert")
                return
            self.store_may_have_lost = False
            self.reasserted += len(todo)
            if todo:
                log.info("re-asserted %d reservations after a store outage", len(todo))

    async def _reassert_one(self, key: Key, tokens: int, created_at: float) -> None:
        if key not in self.held:
            return  # released meanwhile
        reservation_id, backend = key
        # A release while this write is in flight must be a forget (see release()): the
        # write may land after it, and only a forget's marker refuses it.
        self._reasserting_keys.add(key)
        try:
            await self.breaker.call(
                functools.partial(
                    self.store.reserve,
                    backend,
                    reservation_id,
                    tokens,
                    created_at,
                    self.ttl_s,
                    check_fit=False,
                ),
                "reserve",
            )
        except StoreUnavailable:
            # It may still land: release it "unsure" when the request ends.
            self.unsure.add(key)
            raise
        finally:
            self._reasserting_keys.discard(key)

    async def reserve(
        self,
        backend: str,
        reservation_id: str,
        call: Callable[[], Awaitable[bool]],
        tokens: int = 0,
        created_at: float = 0.0,
    ) -> bool:
        """Run one reserve call through the breaker and hold whatever it may have reserved.

        Returns the store's answer; raises StoreUnavailable (holding the id when the call
        was sent, since a paused store may still run it). If the caller is cancelled while
        the call is in flight, the id is forgotten in the background (see the module doc).
        """
        if self.store_may_have_lost:
            # After a store outage, first tell the store what this gateway already placed.
            await self.reassert()
        try:
            ok = await self.breaker.call(call, "reserve")
        except asyncio.CancelledError:
            # Cut off mid-flight (the client went away; nothing before the call awaits, so it
            # was sent): the reserve may have landed, or may land still (a paused Redis runs
            # it later). A forget settles both: it removes the id, and its marker refuses the
            # id should it arrive afterwards.
            self.hold(backend, reservation_id)
            self._spawn(self.release(backend, reservation_id, unsure=True))
            raise
        except StoreUnavailable as exc:
            # Only the breaker's own refusal means the call never reached the store (a
            # delegated breaker always passes it on).
            sent = self.breaker.delegated or not isinstance(exc, CircuitOpen)
            self.on_error("reserve")
            self.hold(backend, reservation_id, sent=sent, tokens=tokens, created_at=created_at)
            # Re-assert it once the store answers, in case it never landed.
            self.mark_unsure()
            if sent:
                # A timed-out reserve may still land after our release: release it "unsure".
                self.unsure.add((reservation_id, backend))
            raise
        if ok:
            self.hold(backend, reservation_id, tokens=tokens, created_at=created_at)
        return ok

    def reserve_at_once(
        self,
        backend: str,
        reservation_id: str,
        call: Callable[[], Coroutine[Any, Any, bool]],
        tokens: int = 0,
        created_at: float = 0.0,
    ) -> bool | None:
        """``reserve()`` without a coroutine of its own, on the embedded store only.

        Its calls never suspend nor fail (no I/O), so the call is run to its end here, with
        the breaker closed (which it stays: nothing fails), instead of through three nested
        awaits (ledger, breaker, store): profiled at ~1% of a tiny request's CPU. None: use
        ``reserve()`` (another store, a re-assert due, a breaker not closed).
        """
        if (
            not self._calls_never_suspend
            or self.store_may_have_lost
            or self.breaker.state != "closed"
        ):
            return None
        ok = result_now(call())
        self.breaker.success()
        if ok:
            self.hold(backend, reservation_id, tokens=tokens, created_at=created_at)
        return ok

    def shrink(self, reservation_id: str, by: int) -> list[tuple[str, int]]:
        """Lower every reservation held under this id by ``by`` tokens: (backend, new size).

        Its exact count came after it was placed on a bound (``proxy.gateway.bound_route``,
        the only caller: a scan is fine). A re-assert writes the lowered size; a store call
        that fails leaves the store's copy larger (over-counted, never over-committed)."""
        lowered = []
        for key, (tokens, created_at) in list(self.claims.items()):
            if key[0] == reservation_id and key in self.held and by > 0:
                lowered.append((key[1], max(0, tokens - by)))
                self.claims[key] = (lowered[-1][1], created_at)
        for backend, tokens in lowered:
            if self._calls_never_suspend:
                assert isinstance(self.store, InProcessStore)
                self.store.shrink_now(backend, reservation_id, tokens)
            else:
                call = functools.partial(self.store.shrink, backend, reservation_id, tokens)
                self._spawn(self._quietly(call, "shrink"))
        return lowered

    async def _quietly(self, call: Callable[[], Awaitable[object]], op: str) -> None:
        try:
            await self.breaker.call(call, op)
        except StoreUnavailable:
            self.on_error(op)

    def _spawn(self, coro: Awaitable[object]) -> None:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def release(self, backend: str, reservation_id: str, *, unsure: bool = False) -> None:
        """Release one reservation; a failed release is queued and retried.

        ``unsure``: the reserve's outcome is unknown (it timed out, or may still be on its
        way), so the store is told to ``forget`` the id: a reserve landing later is refused.
        """
        key = (reservation_id, backend)
        forget = self._settle(key, unsure)
        if forget is None:
            return  # the reserve never reached the store: nothing there to release
        await self._release_settled(key, forget)

    async def _release_settled(self, key: Key, forget: bool) -> None:
        reservation_id, backend = key
        try:
            await self.breaker.call(lambda: self._drop(backend, reservation_id, forget), "release")
        except StoreUnavailable:
            self.on_error("release")
            self.mark_unsure()
            self.pending[key] = self.clock() + self.ttl_s
            self._retries.start()

    def release_at_once(self, backend: str, reservation_id: str) -> bool:
        """``release()`` without a task per request: done before returning on the embedded
        store (its calls never suspend nor fail); on a shared store, queued with the other
        releases of this loop turn, which one task sends in one round trip (a failed batch
        is queued and retried like a failed release). False: use ``release()``."""
        if not self._calls_never_suspend:
            key = (reservation_id, backend)
            forget = self._settle(key, False)
            if forget:
                self._spawn(self._release_settled(key, True))
            elif forget is not None:
                self._batch.append(key)
                if len(self._batch) == 1:
                    self._spawn(self._send_batch())
            return True
        assert isinstance(self.store, InProcessStore)
        forget = self._settle((reservation_id, backend), False)
        if forget:
            self.store.forget_now(backend, reservation_id, self.store.now() + self.ttl_s)
        elif forget is not None:
            self.store.release_now(backend, reservation_id)
        return True

    async def _send_batch(self) -> None:
        """The releases queued until this task runs, in one store call."""
        batch, self._batch = self._batch, []
        try:
            await self.breaker.call(
                lambda: self.store.release_many([(b, rid) for rid, b in batch]), "release"
            )
        except StoreUnavailable:
            self.on_error("release")
            self.mark_unsure()
            give_up = self.clock() + self.ttl_s
            for key in batch:
                self.pending[key] = give_up
            self._retries.start()

    def _settle(self, key: Key, unsure: bool) -> bool | None:
        """Stop holding ``key``; whether its release must be a forget (None: nothing to release)."""
        self.held.pop(key, None)
        self.claims.pop(key, None)
        if key in self._reasserting_keys:
            unsure = True
        if key in self.unsure:
            self.unsure.discard(key)
            unsure = True
        if key in self.unsent:
            self.unsent.discard(key)
            return None
        return unsure

    async def _drop(self, backend: str, reservation_id: str, unsure: bool) -> None:
        if unsure:
            await self.store.forget(backend, reservation_id, self.store.now() + self.ttl_s)
        else:
            await self.store.release(backend, reservation_id)

    async def flush(self) -> None:
        """Retry every queued release once."""
        now = self.clock()
        for key, give_up in list(self.pending.items()):
            if now >= give_up:
                self.pending.pop(key, None)  # expired in the store by now
                continue
            reservation_id, backend = key
            try:
                # A queued release may answer a reserve that lands later still: forget the id.
                await self.breaker.call(
                    functools.partial(self._drop, backend, reservation_id, True), "release"
                )
            except StoreUnavailable:
                return  # still down: the next round tries again
            self.pending.pop(key, None)

    def _still_pending(self) -> bool:
        if self.pending:
            return True
        log.info("every queued reservation release went through")
        return False

    async def close(self, deadline_s: float = 5.0) -> None:
        """Shutdown: release whatever is still held, flush the queue once, stop retrying."""
        if self._bg:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(deadline_s):
                    await asyncio.gather(*self._bg, return_exceptions=True)
        for reservation_id, backend in list(self.held):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(deadline_s):
                    await self.release(backend, reservation_id)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(deadline_s):
                await self.flush()
        await self._retries.stop()
        if self.pending:
            log.warning(
                "%d reservation releases could not be sent; they expire on their own",
                len(self.pending),
            )
