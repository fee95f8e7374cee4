"""Replica leases (proxy.state.lease): a replica that stops renewing takes its reservations
with it, at once, for every replica.

The first half is contract: it runs over both stores (the ``store`` fixture of
test_state_contract: embedded, Redis, Cluster, Sentinel). The second half is two Redis
stores sharing one deployment, as two gateway replicas do: one stops renewing (killed),
and the other's reserve, read and sweep no longer count what it held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from proxy.config import SentinelConfig, StoreConfig
from proxy.state import RedisStore, StateStore
from proxy.state.lease import Lease, lease_field, split_field
from tests.state.test_state_contract import T0, one, rep
from tests.state.test_state_contract import store as store  # the contract's fixture

TTL = 5.0


def held(store: StateStore, base: str = "a") -> Lease:
    lease = Lease(base, TTL)
    store.hold_lease(lease)
    return lease


async def reserved(store: StateStore, name: str, now: float) -> dict[str, tuple[int, str]]:
    st = await one(store, name, now)
    return {r.id: (r.tokens, r.replica) for r in st.reservations}


# --- the contract, on both stores ----------------------------------------------------------
async def test_reservations_carry_the_lease_and_count_while_it_is_renewed(
    store: StateStore,
) -> None:
    held(store)
    first = await store.renew_lease(T0)
    assert (first.lease, first.new, first.lapsed) == ("a.1", True, ())
    await store.put_report("n1", rep(30_000, T0 - 10), ttl_s=60)
    assert await store.reserve("n1", "r1", 20_000, T0 + 1, 900)
    assert await reserved(store, "n1", T0 + 1) == {"r1": (20_000, "a.1")}
    assert not await store.reserve("n1", "r2", 20_000, T0 + 2, 900)
    again = await store.renew_lease(T0 + 4)
    assert (again.lease, again.new) == ("a.1", False)
    # Renewed at T0+4: runs to T0+9, past the first term's end (T0+5).
    assert await reserved(store, "n1", T0 + 8) == {"r1": (20_000, "a.1")}
    assert not await store.reserve("n1", "r2", 20_000, T0 + 8, 900)
    assert await store.live_leases(T0 + 8) == {"a.1": T0 + 9}


async def test_a_lapsed_lease_stops_counting_at_once_and_registers_anew(store: StateStore) -> None:
    lease = held(store)
    await store.renew_lease(T0)
    await store.put_report("n1", rep(30_000, T0 - 10), ttl_s=60)
    assert await store.reserve("n1", "r1", 20_000, T0 + 1, 900)
    # No renewal: at T0+5 the lease has lapsed, and its reservation counts no more (the
    # reservation itself had 896 s left).
    assert await reserved(store, "n1", T0 + 5) == {}
    assert [r.id for r in await store.reservations("n1", T0 + 5)] == []
    assert (await one(store, "n1", T0 + 5)).overlay(T0 + 5, 0.0).reserved_tokens == 0
    assert await store.live_leases(T0 + 5) == {}
    # The replica is back: its next reserve is under a new epoch and fits beside nothing.
    assert await store.reserve("n1", "r2", 20_000, T0 + 6, 900)
    assert lease.id == "a.2"
    assert await reserved(store, "n1", T0 + 6) == {"r2": (20_000, "a.2")}
    # A late release from the old life deletes nothing that counts.
    await store.release("n1", "r1")
    assert await reserved(store, "n1", T0 + 6) == {"r2": (20_000, "a.2")}


async def test_the_renewal_after_a_lapse_sweeps_the_old_life(store: StateStore) -> None:
    held(store)
    await store.renew_lease(T0)
    await store.put_report("n1", rep(60_000, T0 - 10), ttl_s=60)
    assert await store.reserve("n1", "r1", 20_000, T0 + 1, 900)
    assert await store.reserve("n1", "r2", 7_000, T0 + 1, 900)
    assert await store.reserve("n1", "r3", 1_000, T0 + 1, 2)  # expires on its own first
    back = await store.renew_lease(T0 + 20)
    assert (back.lease, back.new, back.lapsed) == ("a.2", True, ("a.1",))
    assert (back.dropped, back.dropped_tokens) == (2, 27_000)
    assert await store.live_leases(T0 + 20) == {"a.2": T0 + 25}
    # Swept: nothing of the old life is left to walk (its lease entry neither).
    assert await store.reserve("n1", "r4", 60_000, T0 + 21, 900)
    assert await reserved(store, "n1", T0 + 21) == {"r4": (60_000, "a.2")}


async def test_release_forget_and_shrink_reach_the_leased_reservation(store: StateStore) -> None:
    held(store)
    await store.renew_lease(T0)
    assert await store.reserve("n1", "r1", 20_000, T0 + 1, 900)
    assert await store.shrink("n1", "r1", 5_000)
    assert await reserved(store, "n1", T0 + 1) == {"r1": (5_000, "a.1")}
    await store.forget("n1", "r1", T0 + 900)
    assert await reserved(store, "n1", T0 + 1) == {}
    # The forget refuses that id's late reserve, as without a lease.
    assert not await store.reserve("n1", "r1", 20_000, T0 + 2, 900)


def test_lease_field_round_trip() -> None:
    assert split_field(lease_field("0af3", "host-1.3")) == ("0af3", "host-1.3")
    assert split_field("0af3") == ("0af3", "")
    # The first "@" separates (the scripts' plain find), neither first nor last.
    assert split_field("a@b@c.1") == ("a", "b@c.1")
    assert split_field("@x") == ("@x", "")
    assert split_field("x@") == ("x@", "")
    with pytest.raises(ValueError):
        Lease("no spaces", TTL)


# --- two replicas on one Redis ---------------------------------------------------------------
@pytest.fixture(params=["redis", "redis-cluster", "redis-sentinel"])
async def deployment(request: pytest.FixtureRequest) -> StoreConfig:
    if request.param == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        return StoreConfig(redis_url=cluster.url, cluster=True, op_timeout_s=2.0)
    if request.param == "redis-sentinel":
        group = request.getfixturevalue("redis_sentinel")
        url = f"redis://127.0.0.1:{group.master_port()}/0"
        cfg = StoreConfig(
            sentinel=SentinelConfig(master=group.name, nodes=group.nodes), op_timeout_s=2.0
        )
    else:
        url = request.getfixturevalue("redis_server")
        cfg = StoreConfig(redis_url=url, op_timeout_s=2.0)
    admin = aioredis.from_url(url)
    await admin.flushdb()
    await admin.aclose()
    return cfg


@pytest.fixture
async def pair(deployment: StoreConfig) -> AsyncIterator[tuple[RedisStore, RedisStore]]:
    a, b = RedisStore(deployment), RedisStore(deployment)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_a_dead_replicas_reservations_stop_counting_for_the_survivor(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = pair
    held(a, "a")
    held(b, "b")
    await a.renew_lease(T0)
    await b.renew_lease(T0)
    for name in ("e0", "e1"):
        await b.put_report(name, rep(30_000, T0 - 10), ttl_s=60)
        assert await a.reserve(name, "ra", 20_000, T0 + 1, 900)
    # Contiguous: the survivor's reserve sees A's pending 20k; lazily allocating (e1, queueing)
    # counts every live reservation at full demand.
    lazy = rep(30_000, T0 - 10, capacity_tokens=30_000, free_tokens=30_000, queueing=True)
    await b.put_report("e1", lazy, ttl_s=60)
    assert not await b.reserve("e0", "rb", 20_000, T0 + 2, 900)
    assert not await b.reserve("e1", "rb", 20_000, T0 + 2, 900)
    # A is killed at T0+2: no more renewals. B renews on; A's lease runs to T0+5.
    await b.renew_lease(T0 + 3)
    assert (await one(b, "e0", T0 + 4.9)).overlay(T0 + 4.9, 0.0).reserved_tokens == 20_000
    assert not await b.reserve("e1", "rb", 20_000, T0 + 4.9, 900)
    # The moment it lapses, B's read and B's reserve (both scripts) no longer count it,
    # before any sweep ran.
    assert (await one(b, "e0", T0 + 5)).overlay(T0 + 5, 0.0).reserved_tokens == 0
    assert await b.reserve("e1", "rb", 20_000, T0 + 5, 900)
    assert await b.reserve("e0", "rb", 20_000, T0 + 5, 900)
    assert await b.live_leases(T0 + 5) == {"b.1": T0 + 8}
    # B's next renewal finds the lapse (once) and sweeps A's reservations out of Redis.
    swept = await b.renew_lease(T0 + 6)
    assert (swept.lapsed, swept.dropped, swept.dropped_tokens) == (("a.1",), 2, 40_000)
    assert (await b.renew_lease(T0 + 7)).lapsed == ()
    assert [r.id for r in await b.reservations("e0", T0 + 7)] == ["rb"]
    # A comes back: a new epoch; its late release of its old reservation touches nothing.
    back = await a.renew_lease(T0 + 8)
    assert (back.lease, back.new) == ("a.2", True)
    await a.release("e0", "ra")
    await a.release_many([("e0", "ra"), ("e1", "ra")])
    assert {r.id: r.replica for r in await b.reservations("e0", T0 + 8)} == {"rb": "b.1"}
    assert set(await a.live_leases(T0 + 8)) == {"a.2", "b.1"}


async def test_a_replica_frozen_past_its_lease_reasserts_under_a_new_epoch(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = pair
    lease_a = held(a, "a")
    held(b, "b")
    epochs: list[str] = []
    lease_a.on_new.append(epochs.append)
    await a.renew_lease(T0)
    await b.renew_lease(T0)
    await b.put_report("e0", rep(30_000, T0 - 10), ttl_s=60)
    assert await a.reserve("e0", "ra", 20_000, T0 + 1, 900)
    # A freezes for 9 s; B renews on and sweeps it meanwhile.
    assert (await b.renew_lease(T0 + 3)).lapsed == ()
    assert (await b.renew_lease(T0 + 6)).lapsed == ("a.1",)
    # A thaws: its renewal finds itself swept and registers anew (on_new: the gateway's
    # ledger then re-asserts what A still holds, here by hand).
    round_ = await a.renew_lease(T0 + 10)
    assert (round_.lease, round_.new, epochs) == ("a.2", True, ["a.1", "a.2"])
    assert await a.reserve("e0", "ra", 20_000, T0 + 10, 900, check_fit=False)
    assert not await b.reserve("e0", "rb", 20_000, T0 + 10, 900)
    assert {r.id: r.replica for r in await b.reservations("e0", T0 + 10)} == {"ra": "a.2"}


async def test_a_lease_lost_with_redis_sweeps_its_own_old_life(
    pair: tuple[RedisStore, RedisStore], deployment: StoreConfig
) -> None:
    """Redis restarted empty: the lease set is gone, so the next renewal registers anew;
    what was reserved meanwhile under the old id is swept (the ledger re-asserts what is
    still held), so its releases, which now name the new id, leave nothing behind."""
    a, _ = pair
    held(a)
    await a.renew_lease(T0)
    assert await a.reserve("e0", "r1", 1_000, T0 + 1, 900)
    raw = a._r  # the deployment's client (Cluster: routed by slot)
    await raw.delete(a._keys.leases_set)  # what a restart without persistence loses
    assert await a.reserve("e0", "r2", 1_000, T0 + 2, 900)  # still under a.1, as a thinks
    back = await a.renew_lease(T0 + 3)
    assert (back.lease, back.new) == ("a.2", True)
    assert await raw.hkeys(a._keys.res("e0")) == []
    assert await a.reserve("e0", "r2", 1_000, T0 + 3, 900, check_fit=False)  # re-asserted
    await a.release("e0", "r2")
    assert await raw.hkeys(a._keys.res("e0")) == []


async def test_a_release_reaches_a_reservation_written_under_an_earlier_id_of_ours(
    pair: tuple[RedisStore, RedisStore],
) -> None:
    """A reservation of ours under an id that then retired (a replay or re-assert racing a
    new epoch, seen once in the fault suite's Redis kill) is deleted by its release: it
    cannot outlive its request until its TTL."""
    a, b = pair
    lease = held(a)
    await a.renew_lease(T0)
    await a.put_report("n1", rep(60_000, T0 - 10), ttl_s=60)
    assert await a.reserve("n1", "r1", 20_000, T0 + 1, 900)
    assert await a.reserve("n1", "r2", 20_000, T0 + 1, 900)
    lease.next_epoch(T0 + 2)  # a new epoch; no renewal has swept the old id yet
    # Old id "a.1" still live until T0+5: both reservations count for the other replica.
    assert set(await reserved(b, "n1", T0 + 3)) == {"r1", "r2"}
    await a.release("n1", "r1")
    await a.release_many([("n1", "r2"), ("n1", "r0")])
    assert await reserved(b, "n1", T0 + 3) == {}
