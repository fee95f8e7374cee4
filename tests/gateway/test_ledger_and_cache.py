"""The reservation ledger's accounting and the fleet cache's single-flight read, under cancellation.

The stores are the real embedded store; ``Gated`` only holds a call until the test lets it
go, to put a cancellation exactly while a store call is in flight.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

import pytest

from proxy.config import Config
from proxy.gateway.ledger import ReservationLedger
from proxy.state.base import BackendState, StoreUnavailable
from proxy.state.breaker import CircuitBreaker
from proxy.state.fleet_cache import FleetCache
from proxy.state.memory import InProcessStore

TTL = 60.0


class Gated(InProcessStore):
    """The embedded store whose read and reserve wait for ``gate`` (set = pass at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def read(self, names: list[str], now: float) -> dict[str, BackendState]:
        await self.gate.wait()
        return await super().read(names, now)

    async def reserve(self, name: str, reservation_id: str, *args: object, **kw: object) -> bool:
        await self.gate.wait()
        return await super().reserve(name, reservation_id, *args, **kw)  # type: ignore[arg-type]


def cfg() -> Config:
    return Config.model_validate(
        {"backends": [{"name": n, "url": f"http://127.0.0.1:1/{n}"} for n in ("a", "b")]}
    )


class Outage(InProcessStore):
    """The embedded store whose releases fail while ``down``: a store outage as the ledger meets it."""

    def __init__(self) -> None:
        super().__init__()
        self.down = True

    def check(self) -> None:
        if self.down:
            raise StoreUnavailable("the store is down")

    async def release(self, name: str, reservation_id: str) -> None:
        self.check()
        await super().release(name, reservation_id)

    async def release_many(self, items: list[tuple[str, str]]) -> None:
        self.check()
        await super().release_many(items)

    async def forget(self, name: str, reservation_id: str, until: float) -> None:
        self.check()
        await super().forget(name, reservation_id, until)


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("at_once", [False, True], ids=["awaited", "batched"])
async def test_a_release_that_fails_is_queued_and_retried_until_it_lands(at_once: bool) -> None:
    store = Outage()
    ledger = ReservationLedger(store, CircuitBreaker(100, 0.01), ttl_s=TTL, retry_interval_s=0.01)
    now = time.time()
    assert await store.reserve("a", "r1", 100, now, TTL, check_fit=False)
    ledger.hold("a", "r1")
    if at_once:
        assert ledger.release_at_once("a", "r1")
    else:
        await ledger.release("a", "r1")
    await until(lambda: bool(ledger.pending), "the failed release to be queued")
    assert [r.id for r in await store.reservations("a", now)] == ["r1"]
    store.down = False
    await until(lambda: not ledger.pending, "the queued release to go through")
    assert await store.reservations("a", now) == []
    await ledger.close()


async def test_cancelling_the_reader_that_owns_the_read_spares_the_others() -> None:
    store = Gated()
    cache = FleetCache(cfg(), store)
    store.gate.clear()
    owner = asyncio.create_task(cache.snapshot(force=True))
    await asyncio.sleep(0.01)
    waiter = asyncio.create_task(cache.snapshot(force=True))
    await asyncio.sleep(0.01)
    owner.cancel()
    await asyncio.sleep(0.01)
    store.gate.set()
    snap = await asyncio.wait_for(waiter, 5)
    assert [n.name for n in snap.nodes] == ["a", "b"]
    assert owner.cancelled()


async def test_a_failed_attempts_release_leaves_the_retrys_reservation() -> None:
    """One reservation id, two backends (attempt 1 on a, its retry on b)."""
    store = InProcessStore()
    ledger = ReservationLedger(store, CircuitBreaker(3, 1.0), ttl_s=TTL)
    now = time.time()
    for backend in ("a", "b"):
        assert await store.reserve(backend, "r1", 100, now, TTL, check_fit=False)
        ledger.hold(backend, "r1")
    await ledger.release("a", "r1")  # the failed attempt
    assert ("r1", "b") in ledger.held
    await ledger.close()  # shutdown releases what is still held: the retry's reservation too
    assert await store.reservations("b", now) == []


@pytest.mark.parametrize("kind", [InProcessStore, Gated], ids=["at_once", "by_task"])
async def test_a_shrink_is_what_a_reassert_writes_and_nothing_after_the_release(
    kind: type[InProcessStore],
) -> None:
    """A request placed on its bound, then counted (``proxy.gateway.bound_route``); the
    embedded store is lowered at once, any other store by a task."""
    store = kind()
    ledger = ReservationLedger(store, CircuitBreaker(3, 1.0), ttl_s=TTL)
    now = time.time()
    call = functools.partial(store.reserve, "a", "r1", 10_000, now, TTL, check_fit=False)
    assert await ledger.reserve("a", "r1", call, tokens=10_000, created_at=now)
    assert ledger.shrink("r1", 6_000) == [("a", 4_000)]
    assert ledger.shrink("other", 6_000) == []

    async def tokens() -> list[int]:
        return [r.tokens for r in await store.reservations("a", now)]

    await until_async(lambda: tokens(), [4_000], "the store's copy lowered")
    # The store lost it (a Redis restart): the re-assert writes the lowered size.
    await store.release("a", "r1")
    ledger.mark_unsure()
    await ledger.reassert()
    assert await tokens() == [4_000]
    await ledger.release("a", "r1")
    assert ledger.shrink("r1", 1_000) == []  # released: nothing held to lower
    assert await tokens() == []


async def until_async(
    read: Callable[[], Awaitable[list[int]]], want: list[int], what: str, timeout_s: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while await read() != want:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_no_release_is_queued_for_a_reserve_never_sent() -> None:
    store = InProcessStore()
    breaker = CircuitBreaker(failures=1, open_s=60.0)
    breaker.failure()  # open: nothing reaches the store
    ledger = ReservationLedger(store, breaker, ttl_s=TTL)
    call = lambda: store.reserve("a", "r1", 100, time.time(), TTL)  # noqa: E731
    with pytest.raises(StoreUnavailable):
        await ledger.reserve("a", "r1", call)
    assert not ledger.held
    await ledger.release("a", "r1")
    ledger.hold("a", "r2", sent=False)  # the same, for a caller that ran the reserve itself
    await ledger.release("a", "r2")
    assert not ledger.pending
    await ledger.close()


async def test_cancelled_while_reserving_leaves_no_reservation() -> None:
    store = Gated()
    ledger = ReservationLedger(store, CircuitBreaker(3, 1.0), ttl_s=TTL)
    store.gate.clear()
    now = time.time()
    request = asyncio.create_task(
        ledger.reserve("a", "r1", lambda: store.reserve("a", "r1", 100, now, TTL))
    )
    await asyncio.sleep(0.01)
    request.cancel()  # the client went away while the reserve call was in flight
    await asyncio.sleep(0.01)
    store.gate.set()  # the reserve lands after all
    for _ in range(100):
        if not await store.reservations("a", now) and not ledger.held:
            break
        await asyncio.sleep(0.01)
    assert await store.reservations("a", now) == []
    assert request.cancelled()
    await ledger.close()


class LandsThenWaits(InProcessStore):
    """A reserve that lands at once but whose answer waits for ``gate``: Redis ran the
    script, the reply is still on its way when the caller is cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def reserve(self, name: str, reservation_id: str, *args: object, **kw: object) -> bool:
        ok = await super().reserve(name, reservation_id, *args, **kw)  # type: ignore[arg-type]
        await self.gate.wait()
        return ok


async def test_cancelled_after_the_reserve_landed_leaves_no_reservation() -> None:
    store = LandsThenWaits()
    ledger = ReservationLedger(store, CircuitBreaker(3, 1.0), ttl_s=TTL)
    now = time.time()
    request = asyncio.create_task(
        ledger.reserve("a", "r1", lambda: store.reserve("a", "r1", 100, now, TTL))
    )
    for _ in range(100):
        if await InProcessStore.reservations(store, "a", now):
            break
        await asyncio.sleep(0.001)
    assert [r.id for r in await store.reservations("a", now)] == ["r1"]
    request.cancel()  # the client went away with the reply still on its way
    for _ in range(100):
        if not await store.reservations("a", now) and not ledger.held:
            break
        await asyncio.sleep(0.01)
    assert await store.reservations("a", now) == []
    assert request.cancelled()
    # Forgotten, not just released: the same id arriving late is refused.
    store.gate.set()
    assert not await store.reserve("a", "r1", 100, now, TTL)
    await ledger.close()


async def test_a_frozen_snapshot_is_not_used_once_its_reports_are_stale() -> None:
    """degraded_mode: snapshot. Past collector.stale_after_s every node of the frozen snapshot
    would count as stale (a request that fits gets 503): route by length only instead."""
    from proxy.config import StoreConfig
    from proxy.core.fleet import MemoryReport
    from proxy.state.redis_store import RedisStore
    from tests.support.redis_server import RedisInstance

    c = cfg()
    clock = [time.time()]
    with RedisInstance() as redis_server:
        store = RedisStore(StoreConfig(redis_url=redis_server.url, op_timeout_s=0.1))
        cache = FleetCache(c, store, clock=lambda: clock[0])
        try:
            report = MemoryReport(
                capacity_tokens=1_000,
                free_tokens=1_000,
                largest_free_block_tokens=1_000,
                reported_at=clock[0],
            )
            await store.put_report("a", report, 60)
            assert (await cache.snapshot(force=True)).by_name()["a"].report is not None
            redis_server.pause()
            try:
                clock[0] += c.collector.stale_after_s / 2  # still fresh: the snapshot bridges
                assert (await cache.snapshot(force=True)).by_name()["a"].report is not None
                clock[0] += c.collector.stale_after_s  # stale now, yet < max_snapshot_age_s
                assert clock[0] - report.reported_at < c.store.max_snapshot_age_s
                snap = await cache.snapshot(force=True)
                assert cache.degraded and snap.by_name()["a"].report is None
            finally:
                redis_server.resume()
        finally:
            await store.close()
