"""One contract for both state stores: the embedded in-process store and Redis.

Every test runs against both (fixture ``store``), and the Redis store in its three
deployments: one server, a 3-master Redis Cluster, and through Sentinel (master + replica +
sentinel), so the gateway behaves the same whichever is configured. Times for reservations
and ceilings are passed in (synthetic, around T0); report, retry-key and lock TTLs run on the
store's own clock. For the in-process store that clock is injected and the expiry tests move
it explicitly; Redis expires keys on its own clock, so there they sleep past a TTL of a full
second (an expiry lower bound, never a speed assertion), a TTL no pause between two calls
comes near.

The ``redis_server`` fixture comes from tests/support/redis_server.py (registered in
tests/conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from proxy.config import SentinelConfig, StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state import (
    BackendState,
    Flags,
    InProcessStore,
    RedisStore,
    StateStore,
    open_store,
)
from tests.support.redis_server import RedisClusterProcs, SentinelGroup

T0 = 1_700_000_000.0
SHORT_TTL = 1.0  # store-clock TTLs in the expiry tests: far above the time between two calls
PAST_TTL = 1.3  # how far those tests move the store's clock (or sleep, for Redis)


class ManualClock:
    """The in-process store's TTL clock, moved only by the test."""

    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


CLOCKS: dict[int, ManualClock] = {}


async def pass_ttl(store: StateStore) -> None:
    """Let PAST_TTL go by on the store's clock: move the injected clock, or sleep for Redis."""
    clock = CLOCKS.get(id(store))
    if clock is not None:
        clock.t += PAST_TTL
    else:
        await asyncio.sleep(PAST_TTL)


def rep(largest: int, reported_at: float = T0, **kw: object) -> MemoryReport:
    fields: dict[str, object] = {
        "capacity_tokens": 100_000,
        "free_tokens": max(largest, 40_000),
        "largest_free_block_tokens": largest,
        "reported_at": reported_at,
        "started_at": T0 - 3600.0,
    }
    fields.update(kw)
    return MemoryReport(**fields)  # type: ignore[arg-type]


@pytest.fixture(params=["memory", "redis", "redis-cluster", "redis-sentinel"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    s: StateStore
    if request.param == "memory":
        clock = ManualClock()
        s = InProcessStore(clock=clock)
        CLOCKS[id(s)] = clock
    elif request.param == "redis-cluster":
        cluster: RedisClusterProcs = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        s = RedisStore(StoreConfig(redis_url=cluster.url, cluster=True, op_timeout_s=2.0))
    elif request.param == "redis-sentinel":
        group: SentinelGroup = request.getfixturevalue("redis_sentinel")
        admin = aioredis.from_url(f"redis://127.0.0.1:{group.master_port()}/0")
        await admin.flushdb()
        await admin.aclose()
        sentinel = SentinelConfig(master=group.name, nodes=group.nodes)
        s = RedisStore(StoreConfig(sentinel=sentinel, op_timeout_s=2.0))
    else:
        url = request.getfixturevalue("redis_server")
        admin = aioredis.from_url(url)
        await admin.flushdb()
        await admin.aclose()
        # A generous deadline: these tests are about behaviour; deadlines have their own tests.
        s = RedisStore(StoreConfig(redis_url=url, op_timeout_s=2.0))
    try:
        yield s
    finally:
        CLOCKS.pop(id(s), None)
        await s.close()


async def one(store: StateStore, name: str, now: float) -> BackendState:
    return (await store.read([name], now))[name]


# --- reports ------------------------------------------------------------------------------
async def test_report_round_trip(store: StateStore) -> None:
    r = MemoryReport(
        capacity_tokens=120_000,
        free_tokens=45_600,
        largest_free_block_tokens=1_200,
        allocator="paged",
        block_size=16,
        running=7,
        waiting=2,
        started_at=T0 - 5 * 86400 + 0.125,
        reported_at=T0 + 0.1,
    )
    await store.put_report("n1", r, ttl_s=60)
    st = await one(store, "n1", T0 + 1)
    assert st.report == r
    assert st.status == "up"
    assert st.status_reason == ""
    assert st.name == "n1"


async def test_report_round_trip_queue_and_engine_fields(store: StateStore) -> None:
    r = MemoryReport(
        capacity_tokens=64_000,
        free_tokens=20_000,
        largest_free_block_tokens=8_000,
        allocator="paged",
        block_size=16,
        running=30,
        waiting=4,
        reported_at=T0,
        preemptions=12,
        engines=2,
        engine_free_tokens=(8_000, 12_000),
        max_num_seqs=256,
        queueing=True,
        sleeping=True,
        prefill_tokens=1_234_567.0,
        prefill_seconds=98.25,
    )
    await store.put_report("dp", r, ttl_s=60)
    assert (await one(store, "dp", T0 + 1)).report == r


async def test_newer_report_replaces_older(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    await store.put_report("n1", rep(5_000, T0 + 1), ttl_s=60)
    st = await one(store, "n1", T0 + 2)
    assert st.report is not None
    assert st.report.largest_free_block_tokens == 5_000
    assert st.report.reported_at == T0 + 1


async def test_report_expires_after_ttl(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000), ttl_s=SHORT_TTL)
    assert (await one(store, "n1", T0)).report is not None
    await pass_ttl(store)
    st = await one(store, "n1", T0)
    assert st.report is None
    assert st.status == "unknown"
    assert "n1" in await store.known_backends()  # known forever, even when the report lapsed


async def test_mark_down_keeps_last_report(store: StateStore) -> None:
    r = rep(30_000)
    await store.put_report("n1", r, ttl_s=60)
    await store.mark_down("n1", "connect refused", ttl_s=60)
    st = await one(store, "n1", T0 + 1)
    assert st.status == "down"
    assert st.status_reason == "connect refused"
    assert st.report == r
    await store.put_report("n1", rep(20_000, T0 + 2), ttl_s=60)
    st = await one(store, "n1", T0 + 3)
    assert (st.status, st.status_reason) == ("up", "")


async def test_mark_down_without_report_and_its_ttl(store: StateStore) -> None:
    await store.mark_down("n2", "timeout", ttl_s=SHORT_TTL)
    st = await one(store, "n2", T0)
    assert (st.status, st.status_reason, st.report) == ("down", "timeout", None)
    assert "n2" in await store.known_backends()
    await pass_ttl(store)
    assert (await one(store, "n2", T0)).status == "unknown"


async def test_read_unknown_names_and_empty(store: StateStore) -> None:
    assert await store.read([], T0) == {}
    await store.put_report("known", rep(10_000), ttl_s=60)
    got = await store.read(["known", "ghost", "ghost"], T0)
    assert set(got) == {"known", "ghost"}
    assert got["ghost"] == BackendState(name="ghost")
    assert got["ghost"].overlay(T0, 0.5).pending_tokens == 0
    assert got["known"].report is not None


async def test_known_backends(store: StateStore) -> None:
    assert await store.known_backends() == set()
    await store.put_report("a", rep(1), ttl_s=60)
    await store.put_report("b:with:colons", rep(1), ttl_s=60)
    await store.put_report("a", rep(2), ttl_s=60)
    await store.reserve("c", "r", 1, T0, 60)  # a reservation alone does not make a backend known
    await store.set_draining("d", True)  # nor does a flag
    assert await store.known_backends() == {"a", "b:with:colons"}


# --- reservations ---------------------------------------------------------------------------
async def test_reserve_and_release(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    assert await store.reserve("n1", "r1", 10_000, T0 + 1, 60)
    assert await store.reserve("n1", "r2", 5_000, T0 + 2, 60)
    live = await store.reservations("n1", T0 + 3)
    assert [(r.id, r.tokens, r.created_at, r.expires_at) for r in live] == [
        ("r1", 10_000, T0 + 1, T0 + 61),
        ("r2", 5_000, T0 + 2, T0 + 62),
    ]
    ov = (await one(store, "n1", T0 + 3)).overlay(T0 + 3, 0.5)
    assert (ov.pending_tokens, ov.reserved_tokens, ov.inflight) == (15_000, 15_000, 2)
    await store.release("n1", "r1")
    await store.release("n1", "never-made")  # no-op
    await store.release("ghost", "r1")  # no-op
    assert [r.id for r in await store.reservations("n1", T0 + 3)] == ["r2"]
    ov = (await one(store, "n1", T0 + 3)).overlay(T0 + 3, 0.5)
    assert (ov.pending_tokens, ov.inflight) == (5_000, 1)


async def test_shrink_lowers_a_live_reservation_and_never_revives_one(store: StateStore) -> None:
    # A request placed on an upper bound of its size, its exact count arriving later
    # (proxy.gateway.bound_route): the room freed is usable at once; its times are kept.
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    assert await store.reserve("n1", "big", 25_000, T0 + 1, 60)
    assert not await store.reserve("n1", "next", 10_000, T0 + 2, 60)
    assert await store.shrink("n1", "big", 12_000)
    assert not await store.shrink("n1", "big", 12_000)  # never raised, nor lowered again
    assert not await store.shrink("n1", "big", 20_000)
    live = await store.reservations("n1", T0 + 2)
    assert [(r.id, r.tokens, r.created_at, r.expires_at) for r in live] == [
        ("big", 12_000, T0 + 1, T0 + 61)
    ]
    assert await store.reserve("n1", "next", 10_000, T0 + 2, 60)  # 12k + 10k fit 30k now
    await store.release("n1", "big")
    # A shrink arriving after its release changes nothing and re-creates nothing.
    assert not await store.shrink("n1", "big", 1_000)
    assert not await store.shrink("ghost", "big", 1_000)
    assert [r.id for r in await store.reservations("n1", T0 + 2)] == ["next"]
    with pytest.raises(ValueError):
        await store.shrink("n1", "next", -1)


async def test_reserve_refused_when_it_would_not_fit(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    assert await store.reserve("n1", "a", 20_000, T0 + 1, 60)
    assert not await store.reserve("n1", "b", 15_000, T0 + 1, 60)  # 35k > 30k
    assert await store.reserve("n1", "c", 10_000, T0 + 1, 60)  # exactly 30k fits
    assert not await store.reserve("n1", "d", 1, T0 + 1, 60)
    assert await store.reserve("n1", "e", 15_000, T0 + 1, 60, check_fit=False)
    ids = {r.id for r in await store.reservations("n1", T0 + 1)}
    assert ids == {"a", "c", "e"}


async def test_reserve_on_a_lazily_allocating_server_counts_full_demand(store: StateStore) -> None:
    # "a" (8k of demand) was reserved before the report, which shows only its 1k prompt
    # cached: the contiguous rule would see 9k free and nothing pending.
    await store.reserve("v", "a", 8_000, T0 - 1, 60, check_fit=False)
    lazy = rep(9_000, T0, capacity_tokens=10_000, free_tokens=9_000, queueing=True)
    await store.put_report("v", lazy, ttl_s=60)
    assert not await store.reserve("v", "b", 8_000, T0 + 1, 60)
    assert await store.reserve("v", "b", 2_000, T0 + 1, 60)  # 10k - max(1k, 8k)
    assert not await store.reserve("v", "c", 1, T0 + 1, 60)


async def test_reserve_where_the_server_shows_requests_late_counts_every_flight(
    store: StateStore,
) -> None:
    """llama.cpp (``counts_flights``): "a" went out before the report, which does not show
    it yet (the server has not taken it). The contiguous rule alone would see 2,048 free and
    nothing pending, and overfilling a unified pool fails every request in flight there."""
    await store.reserve("l", "a", 1_500, T0 - 1, 60, check_fit=False)
    unified = rep(2_048, T0, capacity_tokens=2_048, free_tokens=2_048, counts_flights=True)
    await store.put_report("l", unified, ttl_s=60)
    assert (await one(store, "l", T0 + 1)).report == unified
    assert not await store.reserve("l", "b", 1_500, T0 + 1, 60)
    assert await store.reserve("l", "b", 548, T0 + 1, 60)  # 2,048 - 1,500
    assert not await store.reserve("l", "c", 1, T0 + 1, 60)
    # The contiguous rule still holds on its own: the largest block, less what is pending.
    split = rep(1_000, T0 + 2, capacity_tokens=4_096, free_tokens=2_000, counts_flights=True)
    await store.put_report("s", split, ttl_s=60)
    assert not await store.reserve("s", "a", 1_001, T0 + 3, 60)
    assert await store.reserve("s", "a", 1_000, T0 + 3, 60)


async def test_reserve_where_the_server_queues_what_one_slot_holds_is_never_refused_for_room(
    store: StateStore,
) -> None:
    """llama.cpp's partitioned slots (``queued_up_to_tokens``): every slot busy, and the
    gateway's flights there beyond its cells, yet a request one slot holds waits in the
    server's queue, never refused; one larger than a slot still needs room now."""
    await store.reserve("p", "a", 4_000, T0 - 1, 60, check_fit=False)
    full = rep(
        0,
        T0,
        capacity_tokens=4_096,
        free_tokens=0,
        running=4,
        waiting=2,
        max_num_seqs=4,
        counts_flights=True,
        queued_up_to_tokens=1_024,
    )
    await store.put_report("p", full, ttl_s=60)
    assert (await one(store, "p", T0 + 1)).report == full
    assert await store.reserve("p", "b", 1_024, T0 + 1, 60)
    assert await store.reserve("p", "c", 800, T0 + 1, 60, headroom=0.25)  # exactly 1,000
    assert not await store.reserve("p", "d", 820, T0 + 1, 60, headroom=0.25)  # 1,025
    assert not await store.reserve("p", "d", 1_025, T0 + 1, 60)
    # A larger request fits only where its room is, as before.
    idle = rep(
        2_048,
        T0 + 2,
        capacity_tokens=8_192,
        free_tokens=8_192,
        counts_flights=True,
        queued_up_to_tokens=1_024,
    )
    await store.put_report("q", idle, ttl_s=60)
    assert await store.reserve("q", "a", 2_000, T0 + 3, 60)
    assert not await store.reserve("q", "b", 2_000, T0 + 3, 60)  # pending 2,000 of 2,048
    assert await store.reserve("q", "b", 1_024, T0 + 3, 60)


async def test_reserve_data_parallel_assumes_all_reservations_on_one_engine(
    store: StateStore,
) -> None:
    dp = rep(
        4_000,
        T0,
        capacity_tokens=10_000,
        free_tokens=9_000,
        queueing=True,
        engines=2,
        engine_free_tokens=(4_000, 5_000),
    )
    await store.put_report("dp", dp, ttl_s=60)
    assert await store.reserve("dp", "a", 3_000, T0 + 1, 60)  # the fuller engine has 4k
    assert not await store.reserve("dp", "b", 2_001, T0 + 1, 60)  # 5k - 3k = 2k on either
    assert await store.reserve("dp", "b", 2_000, T0 + 1, 60)


async def test_reserve_headroom(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    assert not await store.reserve("n1", "a", 25_000, T0 + 1, 60, headroom=0.25)  # 31.25k
    assert await store.reserve("n1", "a", 24_000, T0 + 1, 60, headroom=0.25)  # exactly 30k


async def test_reserve_without_report_is_allowed(store: StateStore) -> None:
    assert await store.reserve("fresh", "a", 10**9, T0, 60)
    assert [r.tokens for r in await store.reservations("fresh", T0)] == [10**9]


async def test_reserve_same_id_replaces_not_doubles(store: StateStore) -> None:
    """A retried reserve (lost reply) must not count itself against its own fit."""
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    assert await store.reserve("n1", "a", 25_000, T0 + 1, 60)
    assert await store.reserve("n1", "a", 25_000, T0 + 1, 60)
    live = await store.reservations("n1", T0 + 1)
    assert [(r.id, r.tokens) for r in live] == [("a", 25_000)]


async def test_pending_ignores_reservations_older_than_report(store: StateStore) -> None:
    assert await store.reserve("n1", "old", 20_000, T0, 60)  # before any report
    # The backend's next report (taken 5 s later) already shows the 20k allocated.
    await store.put_report("n1", rep(10_000, T0 + 5), ttl_s=60)
    st = await one(store, "n1", T0 + 6)
    ov = st.overlay(T0 + 6, 0.5)
    assert (ov.pending_tokens, ov.reserved_tokens, ov.inflight) == (0, 20_000, 1)
    # So the old reservation does not count against the reserve check either...
    assert await store.reserve("n1", "new", 10_000, T0 + 6, 60, grace_s=0.5)
    # ...while the new one does.
    assert not await store.reserve("n1", "newer", 1, T0 + 6, 60, grace_s=0.5)
    ov = (await one(store, "n1", T0 + 6)).overlay(T0 + 6, 0.5)
    assert ov.pending_tokens == 10_000


async def test_grace_keeps_reservations_just_before_report_pending(store: StateStore) -> None:
    assert await store.reserve("n1", "r", 8_000, T0 + 4.8, 60)
    await store.put_report("n1", rep(10_000, T0 + 5), ttl_s=60)
    st = await one(store, "n1", T0 + 6)
    assert st.overlay(T0 + 6, 0.5).pending_tokens == 8_000  # 0.2 s before the report: in grace
    assert st.overlay(T0 + 6, 0.1).pending_tokens == 0
    assert not await store.reserve("n1", "x", 3_000, T0 + 6, 60, grace_s=0.5)
    assert await store.reserve("n1", "x", 3_000, T0 + 6, 60, grace_s=0.1)


async def test_expired_reservations_vanish(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    assert await store.reserve("n1", "short", 25_000, T0 + 1, 10)
    assert not await store.reserve("n1", "blocked", 25_000, T0 + 5, 60)
    # At expires_at exactly the reservation is gone (live means expires_at > now).
    assert await store.reservations("n1", T0 + 11) == []
    st = await one(store, "n1", T0 + 11)
    assert st.reservations == ()
    assert st.overlay(T0 + 11, 0.5).inflight == 0
    assert await store.reserve("n1", "next", 25_000, T0 + 11, 60)
    assert [r.id for r in await store.reservations("n1", T0 + 11)] == ["next"]
    # read() of an earlier instant still filters by its own now.
    assert [r.id for r in (await one(store, "n1", T0 + 12)).reservations] == ["next"]


async def test_reserve_rejects_bad_arguments(store: StateStore) -> None:
    with pytest.raises(ValueError):
        await store.reserve("n1", "r", -1, T0, 60)
    with pytest.raises(ValueError):
        await store.reserve("n1", "r", 1, float("nan"), 60)
    with pytest.raises(ValueError):
        await store.reserve("n1", "r", 1, T0, 0)
    assert await store.reservations("n1", T0) == []


# --- flags --------------------------------------------------------------------------------
async def test_draining_and_cooldown(store: StateStore) -> None:
    assert (await one(store, "n1", T0)).flags == Flags()
    await store.set_draining("n1", True)
    await store.set_cooldown("n1", T0 + 30.5)
    st = await one(store, "n1", T0)
    assert st.flags.draining is True
    assert st.flags.cooldown_until == T0 + 30.5
    ov = st.overlay(T0, 0.5)
    assert ov.draining and ov.cooldown_until == T0 + 30.5
    await store.set_draining("n1", False)
    await store.set_cooldown("n1", 0.0)
    assert (await one(store, "n1", T0)).flags == Flags()


async def test_ceiling_lowest_wins_and_expires(store: StateStore) -> None:
    await store.set_ceiling("n1", 20_000, T0, T0 + 30)
    await store.set_ceiling("n1", 25_000, T0 + 1, T0 + 31)  # higher: adds nothing
    f = (await one(store, "n1", T0 + 2)).flags
    assert (f.ceiling_tokens, f.ceiling_set_at, f.ceiling_until) == (20_000, T0, T0 + 30)
    await store.set_ceiling("n1", 15_000, T0 + 2, T0 + 32)  # lower: replaces
    st = await one(store, "n1", T0 + 3)
    assert (st.flags.ceiling_tokens, st.flags.ceiling_until) == (15_000, T0 + 32)
    ov = st.overlay(T0 + 3, 0.5)
    assert (ov.ceiling_tokens, ov.ceiling_until) == (15_000, T0 + 32)
    await store.set_ceiling("n1", 15_000, T0 + 4, T0 + 34)  # same again: refreshed
    f = (await one(store, "n1", T0 + 5)).flags
    assert (f.ceiling_tokens, f.ceiling_set_at, f.ceiling_until) == (15_000, T0 + 4, T0 + 34)
    # Expired: gone from the overlay, and a higher ceiling may now be learned.
    assert (await one(store, "n1", T0 + 34)).overlay(T0 + 34, 0.5).ceiling_tokens is None
    await store.set_ceiling("n1", 28_000, T0 + 40, T0 + 70)
    f = (await one(store, "n1", T0 + 41)).flags
    assert (f.ceiling_tokens, f.ceiling_set_at, f.ceiling_until) == (28_000, T0 + 40, T0 + 70)


async def test_ceiling_lifted_by_newer_bigger_report(store: StateStore) -> None:
    await store.put_report("n1", rep(30_000, T0), ttl_s=60)
    await store.set_ceiling("n1", 22_000, T0 + 1, T0 + 31)
    # A report older than the ceiling does not lift it, even though it shows 30k.
    assert (await one(store, "n1", T0 + 2)).overlay(T0 + 2, 0.5).ceiling_tokens == 22_000
    # A newer report with a smaller block does not lift it.
    await store.put_report("n1", rep(21_000, T0 + 3), ttl_s=60)
    assert (await one(store, "n1", T0 + 4)).overlay(T0 + 4, 0.5).ceiling_tokens == 22_000
    # A newer report with a block >= the ceiling does.
    await store.put_report("n1", rep(22_000, T0 + 5), ttl_s=60)
    ov = (await one(store, "n1", T0 + 6)).overlay(T0 + 6, 0.5)
    assert (ov.ceiling_tokens, ov.ceiling_until) == (None, 0.0)
    # Once lifted, a higher ceiling can be learned (the lifted one is not "in force").
    await store.set_ceiling("n1", 26_000, T0 + 7, T0 + 37)
    ov = (await one(store, "n1", T0 + 8)).overlay(T0 + 8, 0.5)
    assert ov.ceiling_tokens == 26_000


# --- retry memory ---------------------------------------------------------------------------
async def test_retry_memory(store: StateStore) -> None:
    assert await store.failed_on("req-1") == set()
    await store.add_failed("req-1", "n1", ttl_s=60)
    await store.add_failed("req-1", "n2", ttl_s=60)
    await store.add_failed("req-1", "n1", ttl_s=60)
    await store.add_failed("req-2", "n3", ttl_s=60)
    assert await store.failed_on("req-1") == {"n1", "n2"}
    assert await store.failed_on("req-2") == {"n3"}


async def test_retry_memory_expires(store: StateStore) -> None:
    await store.add_failed("req-1", "n1", ttl_s=SHORT_TTL)
    assert await store.failed_on("req-1") == {"n1"}
    await pass_ttl(store)
    assert await store.failed_on("req-1") == set()
    await store.add_failed("req-1", "n2", ttl_s=60)
    assert await store.failed_on("req-1") == {"n2"}


# --- locks --------------------------------------------------------------------------------
async def test_lock_exclusive_extend_unlock(store: StateStore) -> None:
    assert await store.try_lock("restart", "gw-a", 30)
    assert not await store.try_lock("restart", "gw-b", 30)
    assert await store.try_lock("restart", "gw-a", 30)  # extend: ours
    await store.unlock("restart", "gw-b")  # not the owner: no effect
    assert not await store.try_lock("restart", "gw-b", 30)
    await store.unlock("restart", "gw-a")
    assert await store.try_lock("restart", "gw-b", 30)
    assert await store.try_lock("other", "gw-a", 30)  # locks are independent


async def test_lock_expires_and_extension_keeps_it(store: StateStore) -> None:
    assert await store.try_lock("kept", "gw-a", SHORT_TTL)
    assert await store.try_lock("kept", "gw-a", 60)  # extended well past the first TTL
    assert await store.try_lock("lapsed", "gw-a", SHORT_TTL)
    await pass_ttl(store)
    assert not await store.try_lock("kept", "gw-b", 30)
    assert await store.try_lock("lapsed", "gw-b", 30)  # expired: free to take
    await store.unlock("lapsed", "gw-a")  # the old owner cannot release the new owner's lock
    assert not await store.try_lock("lapsed", "gw-a", 30)


# --- events -------------------------------------------------------------------------------
async def test_events_newest_first_and_trimmed(store: StateStore) -> None:
    assert await store.events() == []
    for i in range(7):
        await store.append_event(
            {"i": i, "kind": "restart", "node": "n1", "x": [1.5, None]}, max_len=5
        )
    got = await store.events()
    assert [e["i"] for e in got] == [6, 5, 4, 3, 2]
    assert got[0] == {"i": 6, "kind": "restart", "node": "n1", "x": [1.5, None]}
    assert [e["i"] for e in await store.events(limit=2)] == [6, 5]
    assert await store.events(limit=0) == []


async def test_events_are_copies(store: StateStore) -> None:
    ev = {"k": [1]}
    await store.append_event(ev)
    ev["k"].append(2)
    got = await store.events()
    got[0]["k"].append(3)
    assert await store.events() == [{"k": [1]}]


async def test_event_must_be_json(store: StateStore) -> None:
    with pytest.raises(TypeError):
        await store.append_event({"bad": object()})
    assert await store.events() == []


# --- lifecycle ------------------------------------------------------------------------------
async def test_ping(store: StateStore) -> None:
    assert await store.ping() is True


async def test_open_store_chooses_by_config(redis_server: str) -> None:
    mem = open_store(StoreConfig())
    assert isinstance(mem, InProcessStore)
    red = open_store(StoreConfig(redis_url=redis_server, key_prefix="kvr-factory"))
    try:
        assert isinstance(red, RedisStore)
        assert await red.ping()
    finally:
        await red.close()
        await mem.close()
