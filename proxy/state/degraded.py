"""Degraded mode: the shared Redis store, with this replica's own state behind it.

Measured on the plain Redis store, Redis frozen or killed for 15 s: 934 of 937 requests
went to one engine (one frozen snapshot, no local accounting), and once the frozen reports
were stale, requests that fit got 503 "fragmentation".

``DegradedStore`` composes the shared store with an embedded ``InProcessStore`` behind the
same ``StateStore`` interface; this module decides which store answers each call, while the
local mirror and the replay of what Redis missed live in ``proxy.state.degraded_replay``:

* While Redis answers, every call goes to Redis as before; each read also mirrors the
  reports, statuses and flags into the local store, and each reservation this replica
  makes is recorded there too, so the local view is current the moment Redis stops.
* When a call fails (or the circuit breaker is open), reports, reservations, flags and
  retry memory are served from the local store, exactly as the embedded store would: the
  collector scrapes by itself (its lock call fails, so it needs none) and writes here, and
  reservations are checked and counted here, so placement stays fit-aware and spread.
* When a read succeeds again the replica is back on shared state by itself. Reservations
  made while Redis was away stay counted (merged into every read) until they end or are
  re-registered in Redis in the background with their own times; releases that could not
  be sent are sent then. A release for a reservation Redis never saw is never sent.

Request-path calls never raise ``StoreUnavailable`` (the gateway's own breaker must not
open and send requests out without any reservation); coordination (locks, drain flag,
events) does, since a lock or an operator's action must not be faked locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from proxy.core.fleet import MemoryReport
from proxy.state.base import BackendState, Reservation, StateStore, StoreUnavailable
from proxy.state.breaker import CircuitBreaker, CircuitOpen
from proxy.state.degraded_replay import Key, LocalReplay, SyncState
from proxy.state.lease import Lease, LeaseRound
from proxy.state.memory import InProcessStore

log = logging.getLogger("kvroute.store")

T = TypeVar("T")
CLOCK_REFRESH_S = 30.0


class DegradedStore(StateStore):
    """The shared store first, this replica's in-process store when it does not answer."""

    def __init__(
        self,
        shared: StateStore,
        breaker: CircuitBreaker,
        *,
        reservation_ttl_s: float,
        report_ttl_s: float,
        local: InProcessStore | None = None,
        clock_refresh_s: float = CLOCK_REFRESH_S,
    ) -> None:
        self.shared = shared
        self.local = local if local is not None else InProcessStore()
        self.breaker = breaker
        # This store runs the breaker around each Redis call; callers' call() passes through.
        breaker.delegated = True
        self.reservation_ttl_s = reservation_ttl_s
        self.report_ttl_s = report_ttl_s
        self.clock_refresh_s = clock_refresh_s
        self.shared_errors = 0
        self._degraded = False
        self._replay = LocalReplay(
            shared,
            self.local,
            self._shared,
            self.now,
            reservation_ttl_s=reservation_ttl_s,
            report_ttl_s=report_ttl_s,
        )
        self._synced_at = float("-inf")
        self._tasks: set[asyncio.Task[Any]] = set()
        self._resync: asyncio.Task[None] | None = None

    # --- mode ---
    @property
    def degraded(self) -> bool:
        return self._degraded

    def _set_degraded(self, value: bool) -> None:
        if value != self._degraded:
            self._degraded = value
            log.warning(
                "state store %s",
                "unreachable: routing on local scrapes and local reservations"
                if value
                else "reachable again: back on shared state",
            )

    async def _shared(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One call to Redis through the breaker; a failure marks this replica degraded."""
        try:
            return await self.breaker.guard(fn, what)
        except StoreUnavailable:
            self.shared_errors += 1
            self._set_degraded(True)
            raise

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the shared clock ---
    def now(self) -> float:
        """Redis's clock (as last measured); re-measured in the background every few seconds."""
        mono = time.monotonic()
        if mono - self._synced_at > self.clock_refresh_s and not self._degraded:
            self._synced_at = mono
            with contextlib.suppress(RuntimeError):  # no running loop: measure next time
                asyncio.get_running_loop()
                self._spawn(self._sync_quietly())
        return time.time() + self.shared.clock_offset

    async def _sync_quietly(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self.sync_clock()

    async def sync_clock(self) -> float:
        self._synced_at = time.monotonic()
        self.clock_offset = await self._shared("time", self.shared.sync_clock)
        return self.clock_offset

    # --- reports ---
    async def put_report(self, name: str, report: MemoryReport, ttl_s: float) -> None:
        """Locally first (this replica routes on it at once), then shared; raises when Redis failed."""
        await self.local.put_report(name, report, ttl_s)
        self._replay.wrote_locally(name)
        await self._shared("put_report", lambda: self.shared.put_report(name, report, ttl_s))

    async def mark_down(self, name: str, reason: str, ttl_s: float) -> None:
        await self.local.mark_down(name, reason, ttl_s)
        self._replay.wrote_locally(name)
        await self._shared("mark_down", lambda: self.shared.mark_down(name, reason, ttl_s))

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        try:
            states = await self._shared("read", lambda: self.shared.read(names, now))
        except StoreUnavailable:
            return await self.local.read(names, now)
        self._set_degraded(False)
        local = await self.local.read(names, now)
        out = {n: self._replay.merge(st, local.get(n), now) for n, st in states.items()}
        if self._replay.pending and (self._resync is None or self._resync.done()):
            self._resync = self._spawn(self._replay.resync_all())
        return out

    async def known_backends(self) -> set[str]:
        try:
            return await self._shared("known_backends", self.shared.known_backends)
        except StoreUnavailable:
            return await self.local.known_backends()

    # --- reservations ---
    async def reserve(
        self,
        name: str,
        reservation_id: str,
        tokens: int,
        now: float,
        ttl_s: float,
        *,
        check_fit: bool = True,
        headroom: float = 0.0,
        grace_s: float = 0.0,
    ) -> bool:
        shared_reserve = functools.partial(
            self.shared.reserve,
            name,
            reservation_id,
            tokens,
            now,
            ttl_s,
            check_fit=check_fit,
            headroom=headroom,
            grace_s=grace_s,
        )
        key = (name, reservation_id)
        self._replay.sending(key)
        try:
            try:
                ok = await self._shared("reserve", shared_reserve)
            finally:
                self._replay.sent(key)
        except StoreUnavailable as exc:
            # Sent to Redis unless the breaker refused it (the call may still land there).
            sent = not isinstance(exc, CircuitOpen)
            ok = await self.local.reserve(
                name,
                reservation_id,
                tokens,
                now,
                ttl_s,
                check_fit=check_fit,
                headroom=headroom,
                grace_s=grace_s,
            )
            if ok:
                # A reserve without a fit check is a re-assert of a reservation Redis may
                # already hold (ledger.reassert): its release must reach Redis as well.
                self._replay.reserved_locally(key, sent=sent or not check_fit)
            elif sent:
                self._replay.refused_locally(key, ttl_s)
            return ok
        if ok:
            # Mirror our own reservation, so that it is counted the moment Redis goes away.
            # Redis accepted the same arguments, so they were checked (RedisStore.reserve).
            self.local.reserve_checked(name, reservation_id, tokens, now, ttl_s, check_fit=False)
            self._replay.reserved_shared(key)
        return ok

    async def release(self, name: str, reservation_id: str) -> None:
        """Never raises: a release Redis must see but cannot take now is sent once it answers."""
        await self._replay.drop(name, reservation_id, None)

    async def release_many(self, items: list[tuple[str, str]]) -> None:
        """Never raises, like ``release``; the plain releases reach Redis in one call."""
        await self._replay.drop_many(items)

    async def shrink(self, name: str, reservation_id: str, tokens: int) -> bool:
        """Lowered in the local mirror at once and in Redis when it answers; never raises.

        A shrink Redis misses leaves its copy larger until released: over-counted, never
        over-committed. A reservation made here while Redis was away is re-registered there
        from the local copy, so with its lowered size.
        """
        mine = self.local.shrink_now(name, reservation_id, tokens)
        try:
            theirs = await self._shared(
                "shrink", lambda: self.shared.shrink(name, reservation_id, tokens)
            )
        except StoreUnavailable:
            return mine
        return theirs or mine

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        await self._replay.drop(name, reservation_id, until)

    async def reservations(self, name: str, now: float) -> list[Reservation]:
        try:
            shared = await self._shared("reservations", lambda: self.shared.reservations(name, now))
        except StoreUnavailable:
            return await self.local.reservations(name, now)
        mine = await self.local.reservations(name, now)
        return self._replay.merge_reservations(name, shared, mine, now)

    # --- replica leases: the shared store's (the local mirror holds none) ---
    def hold_lease(self, lease: Lease) -> None:
        super().hold_lease(lease)
        self.shared.hold_lease(lease)

    async def renew_lease(self, now: float) -> LeaseRound:
        return await self._shared("lease", lambda: self.shared.renew_lease(now))

    async def live_leases(self, now: float) -> dict[str, float]:
        return await self._shared("leases", lambda: self.shared.live_leases(now))

    # --- flags: applied here at once, shared best effort (a cooldown or ceiling is advice) ---
    async def set_draining(self, name: str, draining: bool) -> None:
        """An operator's action: must reach Redis, so this one raises when it cannot."""
        await self._shared("set_draining", lambda: self.shared.set_draining(name, draining))
        await self.local.set_draining(name, draining)

    async def set_cooldown(self, name: str, until: float) -> None:
        await self.local.set_cooldown(name, until)
        with contextlib.suppress(StoreUnavailable):
            await self._shared("set_cooldown", lambda: self.shared.set_cooldown(name, until))

    async def set_ceiling(self, name: str, tokens: int, now: float, until: float) -> None:
        await self.local.set_ceiling(name, tokens, now, until)
        with contextlib.suppress(StoreUnavailable):
            await self._shared(
                "set_ceiling", lambda: self.shared.set_ceiling(name, tokens, now, until)
            )

    # --- retry memory ---
    async def add_failed(self, retry_key: str, name: str, ttl_s: float) -> None:
        await self.local.add_failed(retry_key, name, ttl_s)
        with contextlib.suppress(StoreUnavailable):
            await self._shared("add_failed", lambda: self.shared.add_failed(retry_key, name, ttl_s))

    async def failed_on(self, retry_key: str) -> set[str]:
        mine = await self.local.failed_on(retry_key)
        try:
            return mine | await self._shared("failed_on", lambda: self.shared.failed_on(retry_key))
        except StoreUnavailable:
            return mine

    # --- coordination: shared only ---
    async def try_lock(self, lock: str, owner: str, ttl_s: float) -> bool:
        return await self._shared("try_lock", lambda: self.shared.try_lock(lock, owner, ttl_s))

    async def unlock(self, lock: str, owner: str) -> None:
        await self._shared("unlock", lambda: self.shared.unlock(lock, owner))

    async def append_event(self, event: dict[str, Any], max_len: int = 1000) -> None:
        await self._shared("append_event", lambda: self.shared.append_event(event, max_len))

    async def events(self, limit: int = 100) -> list[dict[str, Any]]:
        return await self._shared("events", lambda: self.shared.events(limit))

    # --- lifecycle ---
    async def ping(self) -> bool:
        return await self.shared.ping()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.shared.close()
        await self.local.close()

    # --- for /metrics and tests ---
    def local_only(self) -> dict[Key, SyncState]:
        """Reservations held here that Redis has not seen (yet)."""
        return self._replay.local_only()

    def queued_releases(self) -> int:
        return self._replay.queued_releases()


__all__ = ["DegradedStore"]
