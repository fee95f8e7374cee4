"""The lease keeper (proxy.state.lease_task) on a real Redis: it registers, renews on its
own, and counts the lapses it sweeps; a replica whose keeper stops (a killed one) loses its
reservations for the other within one TTL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from proxy.config import StoreConfig
from proxy.state import RedisStore
from proxy.state.lease_task import LeaseKeeper, LeaseMetrics
from tests.state.test_state_contract import rep

TTL = 0.6


@pytest.fixture
async def stores(redis_server: str) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    admin = aioredis.from_url(redis_server)
    await admin.flushdb()
    await admin.aclose()
    cfg = StoreConfig(redis_url=redis_server, op_timeout_s=2.0, leases=True)
    a, b = RedisStore(cfg), RedisStore(cfg)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_a_stopped_keeper_loses_its_reservations_within_one_ttl(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    a, b = stores
    epochs = {"a": 0, "b": 0}
    ka = LeaseKeeper(a, TTL, lambda: epochs.__setitem__("a", epochs["a"] + 1))
    kb = LeaseKeeper(b, TTL, lambda: epochs.__setitem__("b", epochs["b"] + 1))
    registry = CollectorRegistry()
    registry.register(LeaseMetrics(kb))
    await ka.start()
    await kb.start()
    try:
        await b.put_report("e0", rep(30_000, b.now() - 10), ttl_s=60)
        assert await a.reserve("e0", "ra", 20_000, a.now(), 900)
        # Renewed on its own: after 3 TTLs A's reservation still counts.
        await asyncio.sleep(3 * TTL)
        assert not await b.reserve("e0", "rb", 20_000, b.now(), 900)
        assert kb.live == 2 and epochs == {"a": 1, "b": 1}
        await ka.stop()  # killed: no release, no more renewals
        stopped = asyncio.get_running_loop().time()
        for _ in range(int(2 * TTL / 0.02)):
            if await b.reserve("e0", "rb", 20_000, b.now(), 900):
                break
            await asyncio.sleep(0.02)
        # The last renewal was at most TTL/3 before the stop: it lapses within one TTL.
        assert asyncio.get_running_loop().time() - stopped <= TTL + 0.1
        await asyncio.sleep(TTL)  # B's keeper renews and sweeps meanwhile
        assert (kb.lapsed, kb.dropped, kb.dropped_tokens) == (1, 1, 20_000)
        assert registry.get_sample_value("kvroute_leases_lapsed_total") == 1.0
        assert registry.get_sample_value("kvroute_lease_reserved_tokens_dropped_total") == 20_000
        assert registry.get_sample_value("kvroute_replicas_live") == 1.0
        assert [r.id for r in await b.reservations("e0", b.now())] == ["rb"]
        assert epochs == {"a": 1, "b": 1} and kb.failures == 0
    finally:
        await kb.stop()


async def test_a_keeper_whose_lease_lapsed_registers_anew_and_reasserts(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    a, _ = stores
    calls: list[str] = []

    async def reassert() -> None:
        calls.append("reassert")

    keeper = LeaseKeeper(a, TTL, lambda: calls.append("unsure"), reassert)
    await keeper.start()
    await keeper.stop()  # a replica starved (or cut off from Redis) past its TTL
    first = keeper.lease.id
    await asyncio.sleep(TTL + 0.1)
    round_ = await keeper.renew()
    assert round_.new and round_.lease != first and keeper.registrations == 2
    # Marked unsure for the request path, and re-asserted at once by the keeper itself.
    assert calls == ["unsure", "unsure", "reassert"]
    assert (await keeper.renew()).new is False and calls[-1] == "reassert" and len(calls) == 3


async def test_a_reassert_under_a_new_epoch_moves_the_reservation_not_doubles_it(
    stores: tuple[RedisStore, RedisStore],
) -> None:
    """Between a new epoch (the lease lapsed during an outage) and the renewal that sweeps the
    old id, the ledger may re-assert first (its next reservation does): the reservation is
    moved to the new id, so it never counts twice, and a fit check beside it sees it once."""
    a, b = stores
    keeper = LeaseKeeper(a, 30.0)  # no renewal during the test: nothing is swept
    await keeper.start()
    try:
        await b.put_report("e0", rep(30_000, b.now() - 10), ttl_s=60)
        assert await a.reserve("e0", "kept", 12_000, a.now(), 900)
        assert a.lease is not None
        old = a.lease.id
        a.lease.next_epoch(a.now())  # its lease lapsed (a long outage): a new id
        assert await a.reserve("e0", "kept", 12_000, a.now(), 900, check_fit=False)
        live = await b.reservations("e0", b.now())
        assert [(r.id, r.replica) for r in live] == [("kept", a.lease.id)] and a.lease.id != old
        # 30,000 - 12,000 counted once: 18,000 still fits.
        assert await b.reserve("e0", "other", 18_000, b.now(), 900)
    finally:
        await keeper.stop()
