"""The degraded-mode store (proxy.state.degraded) against a real redis-server, paused with SIGSTOP.

What it must do while Redis is away: answer every request-path call from local state
(never raise), check fit locally against the last known figures, keep this replica's
reservations counted, and once Redis answers again re-register those reservations with
their own times and send the releases it missed, but none for reserves Redis never saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from proxy.config import StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state.base import StoreUnavailable
from proxy.state.breaker import CircuitBreaker
from proxy.state.degraded import DegradedStore
from proxy.state.redis_store import RedisStore
from tests.support.redis_server import RedisInstance

TTL = 60.0


@pytest.fixture
def instance() -> Iterator[RedisInstance]:
    inst = RedisInstance()
    inst.start()
    try:
        yield inst
    finally:
        if inst.paused:
            inst.resume()
        inst.close()


@pytest.fixture
async def stores(instance: RedisInstance) -> AsyncIterator[tuple[DegradedStore, RedisStore]]:
    """The wrapper, and a second plain client on the same Redis to look behind its back."""
    cfg = StoreConfig(redis_url=instance.url, op_timeout_s=0.1)
    store = DegradedStore(
        RedisStore(cfg),
        CircuitBreaker(failures=2, open_s=0.2),
        reservation_ttl_s=TTL,
        report_ttl_s=TTL,
    )
    peek = RedisStore(cfg)
    try:
        yield store, peek
    finally:
        if instance.paused:
            instance.resume()
        await store.close()
        await peek.close()


def report(largest: int, at: float) -> MemoryReport:
    return MemoryReport(
        capacity_tokens=30_000,
        free_tokens=largest,
        largest_free_block_tokens=largest,
        reported_at=at,
    )


async def wait_until(pred: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_reserves_locally_fit_aware_and_reregisters(
    instance: RedisInstance, stores: tuple[DegradedStore, RedisStore]
) -> None:
    store, peek = stores
    now = store.now()
    await peek.put_report("n1", report(30_000, now), TTL)
    # A reservation made while Redis answers is mirrored locally.
    assert await store.reserve("n1", "shared-1", 5_000, now, TTL)
    await store.read(["n1"], now)  # mirrors the report
    instance.pause()
    t = store.now()
    # The request path never raises; fit is checked against the mirrored report and
    # this replica's own reservations (5,000 + 20,000 fit in 30,000; another 20,000 does not).
    assert await store.reserve("n1", "local-1", 20_000, t, TTL)
    assert not await store.reserve("n1", "local-2", 20_000, t, TTL)
    states = await store.read(["n1"], t)
    assert store.degraded
    assert {r.id for r in states["n1"].reservations} == {"shared-1", "local-1"}
    instance.resume()
    created = {r.id: r.created_at for r in states["n1"].reservations}

    async def back() -> bool:
        await store.read(["n1"], store.now())
        got = {r.id: r.created_at for r in await peek.reservations("n1", store.now())}
        return not store.degraded and got == created and not store.local_only()

    await wait_until(back, "Redis to hold both reservations with their own times")
    await store.release("n1", "local-1")
    await store.release("n1", "shared-1")
    assert await peek.reservations("n1", store.now()) == []


async def test_releases_missed_are_sent_but_never_for_unsent_reserves(
    instance: RedisInstance, stores: tuple[DegradedStore, RedisStore]
) -> None:
    store, peek = stores
    now = store.now()
    assert await store.reserve("n1", "shared-1", 100, now, TTL, check_fit=False)
    instance.pause()
    # Open the circuit: from then on nothing is sent to Redis.
    for _ in range(3):
        await store.read(["n1"], store.now())
    assert store.breaker.state == "open"
    assert await store.reserve("n1", "never-sent", 100, store.now(), TTL)
    assert store.local_only() == {("n1", "never-sent"): "local"}
    await store.release("n1", "never-sent")
    await store.release("n1", "shared-1")  # Redis must see this one
    assert store.queued_releases() == 1 and store.local_only() == {}
    instance.resume()

    async def sent() -> bool:
        await store.read(["n1"], store.now())
        return store.queued_releases() == 0

    await wait_until(sent, "the missed release to be sent")
    assert await peek.reservations("n1", store.now()) == []


async def test_request_path_never_raises_but_coordination_does(
    instance: RedisInstance, stores: tuple[DegradedStore, RedisStore]
) -> None:
    store, _ = stores
    instance.pause()
    now = store.now()
    await store.set_cooldown("n1", now + 5)
    await store.set_ceiling("n1", 1_000, now, now + 5)
    await store.add_failed("key", "n1", 30)
    assert await store.failed_on("key") == {"n1"}
    st = (await store.read(["n1"], now))["n1"]
    assert st.flags.cooldown_until == now + 5 and st.flags.ceiling_tokens == 1_000
    with pytest.raises(StoreUnavailable):
        await store.try_lock("collector", "me", 1.0)
    with pytest.raises(StoreUnavailable):
        await store.set_draining("n1", True)


async def test_clock_offset_is_measured_against_redis_time(
    stores: tuple[DegradedStore, RedisStore],
) -> None:
    store, peek = stores
    offset = await store.sync_clock()
    # Same host: the offset is the measuring error only (well under the 0.1 s deadline).
    assert abs(offset) < 0.1
    assert abs(store.now() - await peek.server_time()) < 0.1


async def test_shrink_reaches_both_copies_and_never_raises(
    instance: RedisInstance, stores: tuple[DegradedStore, RedisStore]
) -> None:
    store, peek = stores
    now = store.now()
    await peek.put_report("n1", report(30_000, now), TTL)
    assert await store.reserve("n1", "shared-1", 20_000, now, TTL)
    assert await store.shrink("n1", "shared-1", 8_000)
    assert [r.tokens for r in await peek.reservations("n1", store.now())] == [8_000]
    assert [r.tokens for r in await store.local.reservations("n1", store.now())] == [8_000]
    await store.read(["n1"], now)  # mirrors the report
    instance.pause()
    t = store.now()
    assert await store.reserve("n1", "local-1", 9_000, t, TTL)
    # Redis away: lowered here at once, never raised to the caller.
    assert await store.shrink("n1", "local-1", 4_000)
    assert await store.shrink("n1", "shared-1", 6_000)
    instance.resume()

    async def back() -> bool:
        await store.read(["n1"], store.now())
        return not store.degraded and not store.local_only()

    await wait_until(back, "Redis to hold the reservation made while it was away")
    tokens = {r.id: r.tokens for r in await peek.reservations("n1", store.now())}
    # Made here while Redis was away: registered there at its lowered size. The shrink
    # Redis missed leaves its copy larger until released (over-counted, never over-committed).
    assert tokens == {"local-1": 4_000, "shared-1": 8_000}


async def test_release_during_a_reassert_in_flight_reaches_redis(
    instance: RedisInstance, stores: tuple[DegradedStore, RedisStore]
) -> None:
    """A reservation made while Redis was away is re-asserted (the ledger's reassert, a
    reserve with no fit check) and released while that reserve is on its way: the release
    must reach Redis as a forget, or the re-assert lands after it and counts until its TTL
    (seen in the fault suite before: 1-3 such reservations after every frozen-Redis run)."""
    store, peek = stores
    instance.pause()
    for _ in range(3):
        await store.read(["n1"], store.now())
    assert store.breaker.state == "open"
    assert await store.reserve("n1", "made-away", 100, store.now(), TTL)
    assert store.local_only() == {("n1", "made-away"): "local"}
    instance.resume()
    await asyncio.sleep(0.3)  # past the breaker's open_s: the next call is sent
    # Redis holds every command for 60 ms (well inside the 0.1 s deadline): the re-assert
    # is sent, and the release made while it waits must be sent behind it.
    await peek._r.execute_command("CLIENT", "PAUSE", "60")
    reassert = asyncio.create_task(
        store.reserve("n1", "made-away", 100, store.now(), TTL, check_fit=False)
    )
    await asyncio.sleep(0.01)
    await store.forget("n1", "made-away", store.now() + TTL)
    assert await reassert

    async def released() -> bool:
        await store.read(["n1"], store.now())  # what the gateway does: sends what is queued
        return await peek.reservations("n1", store.now()) == []

    await wait_until(released, "the re-asserted reservation to be released in Redis", 3.0)
    assert store.local_only() == {} and store.queued_releases() == 0
