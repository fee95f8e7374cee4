"""What only this replica knows while Redis is away, and how it gets back into Redis.

Degraded mode (``proxy.state.degraded``) routes on a local in-process store when Redis does
not answer. This module holds the bookkeeping that makes that safe, apart from the
``StateStore`` wrapper that decides which store answers a call:

* the local mirror: each shared read is copied into the local store (only when it changed),
  so the local view is current the moment Redis stops;
* reservations made locally that Redis has not seen, and releases Redis missed;
* the replay once Redis answers again: missed releases are sent (as forgets, since the
  reserve they answer may itself arrive late), then local reservations are re-registered
  with their own times. A release for a reservation Redis never saw is never sent.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from typing import Literal, Protocol, TypeVar

from proxy.state.base import (
    BackendState,
    Reservation,
    StateStore,
    StoreUnavailable,
    live_reservations,
)
from proxy.state.memory import InProcessStore

T = TypeVar("T")
Key = tuple[str, str]
#: Where a reservation held only locally stands with Redis.
#: local: never sent (release locally only); maybe: the reserve timed out and may still land;
#: syncing: being re-registered now; released: released while being re-registered.
SyncState = Literal["local", "maybe", "syncing", "released"]


class SharedCall(Protocol):
    """One call to Redis through the breaker (raises StoreUnavailable, marks degraded)."""

    def __call__(self, what: str, fn: Callable[[], Awaitable[T]], /) -> Awaitable[T]: ...


class LocalReplay:
    """The local mirror, the reservations and releases Redis has not seen, and their replay."""

    def __init__(
        self,
        shared: StateStore,
        local: InProcessStore,
        call: SharedCall,
        now: Callable[[], float],
        *,
        reservation_ttl_s: float,
        report_ttl_s: float,
    ) -> None:
        self.shared = shared
        self.local = local
        self._call = call
        self._now = now
        self.reservation_ttl_s = reservation_ttl_s
        self.report_ttl_s = report_ttl_s
        self._unsynced: dict[Key, SyncState] = {}
        # Shared releases to send; value: give up at (monotonic).
        self._releases: dict[Key, float] = {}
        # Reserves sent to Redis that it did not answer: the command may still run after our
        # release (a paused Redis resumes; a timed-out connection's buffer is read), so their
        # release is always a forget, which refuses that late reserve.
        self._may_land_late: set[Key] = set()
        # Shared reserves on their way now, per key (a re-assert of a reservation made while
        # Redis was away, ``ledger.reassert``): one may land after a release made meanwhile,
        # so that release must reach Redis, as a forget, even for a reservation held only
        # here. Measured without it: 1-3 reservations left in Redis after each frozen-Redis
        # fault run, a re-assert landing 50 ms after the request had ended.
        self._in_flight: Counter[Key] = Counter()
        self._mirrored: dict[str, tuple[object, ...]] = {}

    # --- the mirror ---
    def wrote_locally(self, name: str) -> None:
        """Our own report or status went to the local store: mirror the next shared read again."""
        self._mirrored.pop(name, None)

    def merge(self, st: BackendState, mine: BackendState | None, now: float) -> BackendState:
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

    def merge_reservations(
        self, name: str, shared: list[Reservation], mine: list[Reservation], now: float
    ) -> list[Reservation]:
        """Redis's reservations of ``name`` plus ours that it has not seen."""
        ids = {r.id for r in shared}
        extra = [r for r in mine if r.id not in ids and (name, r.id) in self._unsynced]
        return list(live_reservations([*shared, *extra], now))

    # --- reservations Redis has not seen ---
    @property
    def pending(self) -> bool:
        """Anything to replay once Redis answers."""
        return bool(self._unsynced or self._releases)

    def reserved_locally(self, key: Key, *, sent: bool) -> None:
        """A reserve Redis did not answer was granted locally (``sent``: it may still land)."""
        self._unsynced[key] = "maybe" if sent else "local"
        if sent:
            self._may_land_late.add(key)

    def refused_locally(self, key: Key, ttl_s: float) -> None:
        """Refused here, but the shared reserve may still run once Redis resumes."""
        self._releases[key] = time.monotonic() + ttl_s

    def sending(self, key: Key) -> None:
        """A shared reserve of ``key`` is on its way (``sent`` when it has answered or failed)."""
        self._in_flight[key] += 1

    def sent(self, key: Key) -> None:
        self._in_flight[key] -= 1
        if self._in_flight[key] <= 0:
            del self._in_flight[key]

    def reserved_shared(self, key: Key) -> None:
        self._unsynced.pop(key, None)

    async def drop(self, name: str, reservation_id: str, until: float | None) -> None:
        """Release (``until`` None) or forget, locally at once and in Redis when it answers."""
        key = (name, reservation_id)
        send, until = await self._drop_here(key, until)
        if send:
            await self._send_one(key, until)

    async def _send_one(self, key: Key, until: float | None) -> None:
        name, reservation_id = key
        try:
            if until is None:
                await self._call("release", lambda: self.shared.release(name, reservation_id))
            else:
                await self._call("forget", lambda: self.shared.forget(name, reservation_id, until))
        except StoreUnavailable:
            self._releases[key] = time.monotonic() + self.reservation_ttl_s

    async def drop_many(self, items: list[Key]) -> None:
        """``drop`` (release) of several: the plain releases go to Redis in one call."""
        batch: list[Key] = []
        for name, reservation_id in items:
            key = (name, reservation_id)
            send, until = await self._drop_here(key, None)
            if not send:
                continue
            if until is not None:
                await self._send_one(key, until)  # now a forget: sent on its own
            else:
                batch.append(key)
        if not batch:
            return
        try:
            await self._call("release", lambda: self.shared.release_many(batch))
        except StoreUnavailable:
            give_up = time.monotonic() + self.reservation_ttl_s
            for key in batch:
                self._releases[key] = give_up

    async def _drop_here(self, key: Key, until: float | None) -> tuple[bool, float | None]:
        """The local half of ``drop``: whether Redis must be told, and ``until`` for a forget."""
        name, reservation_id = key
        in_flight = key in self._in_flight
        if key in self._may_land_late or in_flight:
            self._may_land_late.discard(key)
            if until is None:
                until = self._now() + self.reservation_ttl_s
        if until is None:
            await self.local.release(name, reservation_id)
        else:
            # Its marker also refuses the local mirror of a reserve still on its way.
            await self.local.forget(name, reservation_id, until)
        state = self._unsynced.get(key)
        if state == "local" and not in_flight:
            del self._unsynced[key]
            return False, until
        if state in ("syncing", "released"):
            # The re-registration in flight releases it when it is done (in that order).
            self._unsynced[key] = "released"
            return False, until
        self._unsynced.pop(key, None)
        return True, until

    # --- the replay ---
    async def resync_all(self) -> None:
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
            until = self._now() + self.reservation_ttl_s
            await self._call("forget", partial(self.shared.forget, name, rid, until))
            self._releases.pop(key, None)

    async def _reregister(self) -> None:
        now = self._now()
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
                await self._call("reserve", again)
            except StoreUnavailable:
                if self._unsynced.get(key) == "released":
                    self._unsynced.pop(key, None)
                    self._releases[key] = time.monotonic() + self.reservation_ttl_s
                else:
                    self._unsynced[key] = "maybe"
                raise
            if self._unsynced.pop(key, None) == "released":
                try:
                    # A forget: the reserve first sent while Redis was away may still land.
                    until = self._now() + self.reservation_ttl_s
                    await self._call("forget", partial(self.shared.forget, name, rid, until))
                except StoreUnavailable:
                    self._releases[key] = time.monotonic() + self.reservation_ttl_s
                    raise

    # --- for /metrics and tests ---
    def local_only(self) -> dict[Key, SyncState]:
        """Reservations held here that Redis has not seen (yet)."""
        return dict(self._unsynced)

    def queued_releases(self) -> int:
        return len(self._releases)
