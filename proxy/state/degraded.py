"""Degraded mode: the shared Redis store, with this replica's own state behind it.

Measured on the plain Redis store, Redis frozen or killed for 15 s: 934 of 937 requests
went to one engine (one frozen snapshot, no local accounting), and once the frozen reports
were stale, requests that fit got 503 "fragmentation".

``DegradedStore`` composes the shared store with an embedded ``InProcessStore`` behind the
same ``StateStore`` interface:

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
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Any, Literal, TypeVar

from proxy.core.fleet import MemoryReport
from proxy.state.base import (
    BackendState,
    Reservation,
    StateStore,
    StoreUnavailable,
    live_reservations,
)
from proxy.state.breaker import CircuitBreaker
from proxy.state.memory import InProcessStore

log = logging.getLogger("kvroute.store")

T = TypeVar("T")
Key = tuple[str, str]
#: Where a reservation held only locally stands with Redis.
#: local: never sent (release locally only); maybe: the reserve timed out and may still land;
#: syncing: being re-registered now; released: released while being re-registered.
SyncState = Literal["local", "maybe", "syncing", "released"]
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
        self._unsynced: dict[Key, SyncState] = {}
        self._releases: dict[
            Key, float
        ] = {}  # shared releases to send; value: give up at (monotonic)
        self._mirrored: dict[str, tuple[Any, ...]] = {}
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
        self._mirrored.pop(name, None)
        await self._shared("put_report", lambda: self.shared.put_report(name, report, ttl_s))

    async def mark_down(self, name: str, reason: str, ttl_s: float) -> None:
        await self.local.mark_down(name, reason, ttl_s)
        self._mirrored.pop(name, None)
        await self._shared("mark_down", lambda: self.shared.mark_down(name, reason, ttl_s))

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        try:
            states = await self._shared("read", lambda: self.shared.read(names, now))
        except StoreUnavailable:
            return await self.local.read(names, now)
        self._set_degraded(False)
        local = await self.local.read(names, now)
        out = {n: self._merge(st, local.get(n), now) for n, st in states.items()}
        if (self._unsynced or self._releases) and (self._resync is None or self._resync.done()):
            self._resync = self._spawn(self._resync_all())
        return out

    def _merge(self, st: BackendState, mine: BackendState | None, now: float) -> BackendState:
        """Shared state, mirrored locally; plus what only this replica knows (newer scrape, unsynced reservations)."""
        key = (st.report, st.status, st.status_reason, st.flags)
        if self._mirrored.get(st.name) != key:
            self.local.adopt(st, self.report_ttl_s)
            self._mirrored[st.name] = key
        if mine is None:
            return st
        if mine.report is not None and (
            st.report is None or mine.report.reported_at > st.report.reported_at
        ):
            # Right after an outage Redis's reports may have expired: our own scrape is newer.
            st = replace(st, report=mine.report, status=mine.status)
        if self._unsynced:
            extra = [
                r
                for r in mine.reservations
                if (st.name, r.id) in self._unsynced
                and self._unsynced[(st.name, r.id)] != "released"
            ]
            if extra:
                ids = {r.id for r in st.reservations}
                extra = [r for r in extra if r.id not in ids]
                st = replace(st, reservations=live_reservations([*st.reservations, *extra], now))
        return st

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
        sent = False

        async def shared_reserve() -> bool:
            nonlocal sent
            sent = True
            return await self.shared.reserve(
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
        try:
            ok = await self._shared("reserve", shared_reserve)
        except StoreUnavailable:
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
                self._unsynced[key] = "maybe" if sent else "local"
            elif sent:
                # Refused here, but the shared reserve may still run once Redis resumes.
                self._releases[key] = time.monotonic() + ttl_s
            return ok
        if ok:
            # Mirror our own reservation, so that it is counted the moment Redis goes away.
            await self.local.reserve(name, reservation_id, tokens, now, ttl_s, check_fit=False)
            self._unsynced.pop(key, None)
        return ok

    async def release(self, name: str, reservation_id: str) -> None:
        """Never raises: a release Redis must see but cannot take now is sent once it answers."""
        await self._drop(name, reservation_id, None)

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        await self._drop(name, reservation_id, until)

    async def _drop(self, name: str, reservation_id: str, until: float | None) -> None:
        key = (name, reservation_id)
        if until is None:
            await self.local.release(name, reservation_id)
        else:
            await self.local.forget(name, reservation_id, until)
        state = self._unsynced.get(key)
        if state == "local":
            del self._unsynced[key]
            return
        if state in ("syncing", "released"):
            # The re-registration in flight releases it when it is done (in that order).
            self._unsynced[key] = "released"
            return
        self._unsynced.pop(key, None)
        try:
            if until is None:
                await self._shared("release", lambda: self.shared.release(name, reservation_id))
            else:
                await self._shared(
                    "forget", lambda: self.shared.forget(name, reservation_id, until)
                )
        except StoreUnavailable:
            self._releases[key] = time.monotonic() + self.reservation_ttl_s

    async def reservations(self, name: str, now: float) -> list[Reservation]:
        try:
            shared = await self._shared("reservations", lambda: self.shared.reservations(name, now))
        except StoreUnavailable:
            return await self.local.reservations(name, now)
        ids = {r.id for r in shared}
        mine = [
            r
            for r in await self.local.reservations(name, now)
            if r.id not in ids and (name, r.id) in self._unsynced
        ]
        return list(live_reservations([*shared, *mine], now))

    async def _resync_all(self) -> None:
        """Back on Redis: send the releases it missed, then re-register local reservations."""
        try:
            await self._send_releases()
            await self._reregister()
        except StoreUnavailable:
            return  # down again: the next successful read starts over

    async def _send_releases(self) -> None:
        for key, give_up in list(self._releases.items()):
            if time.monotonic() >= give_up:
                self._releases.pop(key, None)  # expired in Redis by now
                continue
            name, rid = key
            # A forget, not a plain release: the reserve it answers may itself arrive late.
            until = self.now() + self.reservation_ttl_s
            await self._shared("forget", partial(self.shared.forget, name, rid, until))
            self._releases.pop(key, None)

    async def _reregister(self) -> None:
        now = self.now()
        for key, state in list(self._unsynced.items()):
            if state not in ("local", "maybe"):
                continue
            name, rid = key
            mine = {r.id: r for r in await self.local.reservations(name, now)}
            r = mine.get(rid)
            if r is None:
                self._unsynced.pop(key, None)
                continue
            self._unsynced[key] = "syncing"
            try:
                # Its own times: a reservation older than a report is already counted in it.
                ttl = r.expires_at - r.created_at
                again = partial(
                    self.shared.reserve, name, rid, r.tokens, r.created_at, ttl, check_fit=False
                )
                await self._shared("reserve", again)
            except StoreUnavailable:
                if self._unsynced.get(key) == "released":
                    self._unsynced.pop(key, None)
                    self._releases[key] = time.monotonic() + self.reservation_ttl_s
                else:
                    self._unsynced[key] = "maybe"
                raise
            if self._unsynced.pop(key, None) == "released":
                try:
                    await self._shared("release", partial(self.shared.release, name, rid))
                except StoreUnavailable:
                    self._releases[key] = time.monotonic() + self.reservation_ttl_s
                    raise

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
        return dict(self._unsynced)

    def queued_releases(self) -> int:
        return len(self._releases)


__all__ = ["DegradedStore"]
