"""Redis-only behaviour: replicas racing, outside writers, the key schema, and faults.

Uses the session ``redis_server`` (tests/support/redis_server.py) for the shared-server
tests and separate ``RedisInstance`` servers for the ones that stop, pause or restart
Redis. No test asserts speed: fault tests only assert that StoreUnavailable is raised, and
an outer asyncio.timeout keeps each test bounded if a call ever hung.
"""

from __future__ import annotations

import asyncio
import random
import re
import shlex
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection

from proxy.config import StoreConfig
from proxy.core.fleet import MemoryReport
from proxy.state import InProcessStore, RedisStore, StateStore, StoreUnavailable
from tests.state.test_deadline import hold_the_loop
from tests.support.redis_server import RedisInstance

T0 = 1_700_000_000.0
DOC = Path(__file__).resolve().parents[2] / "docs" / "redis-schema.md"
BOUND_S = 20.0  # a test that takes this long has hung: fail it instead of waiting forever


@pytest.fixture
async def admin(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client on the shared server, DB flushed: what a custom server would use."""
    r = aioredis.from_url(redis_server, decode_responses=True)
    await r.flushdb()
    try:
        yield r
    finally:
        await r.aclose()


def count_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, every command write to Redis is counted in the list's one item."""
    sends = [0]
    original = AbstractConnection.send_packed_command

    async def counting(self: AbstractConnection, *args: Any, **kw: Any) -> None:
        sends[0] += 1
        await original(self, *args, **kw)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return sends


def store_for(url: str, **kw: Any) -> RedisStore:
    return RedisStore(StoreConfig(redis_url=url, **{"op_timeout_s": 2.0, **kw}))


def rep(largest: int, reported_at: float = T0) -> MemoryReport:
    return MemoryReport(
        capacity_tokens=100_000,
        free_tokens=max(largest, 38_000),
        largest_free_block_tokens=largest,
        reported_at=reported_at,
    )


# --- concurrency: replicas share one store ----------------------------------------------------
async def test_two_replicas_never_overcommit_a_block(
    admin: aioredis.Redis, redis_server: str
) -> None:
    a, b = store_for(redis_server), store_for(redis_server)
    try:
        await a.put_report("n1", rep(30_000), ttl_s=60)
        rng = random.Random(7)
        sizes = [rng.randint(500, 12_000) for _ in range(240)]

        async def attempt(i: int) -> tuple[int, bool]:
            s = a if i % 2 == 0 else b
            return sizes[i], await s.reserve("n1", f"r{i}", sizes[i], T0 + 1, 60)

        async with asyncio.timeout(BOUND_S):
            results = await asyncio.gather(*(attempt(i) for i in range(len(sizes))))
        granted = sum(t for t, ok in results if ok)
        assert 0 < granted <= 30_000
        assert any(not ok for _, ok in results)
        live = await b.reservations("n1", T0 + 1)
        assert sum(r.tokens for r in live) == granted
        assert {r.id for r in live} == {f"r{i}" for i, (_, ok) in enumerate(results) if ok}
    finally:
        await a.close()
        await b.close()


async def test_two_gateways_cannot_both_take_one_gap(
    admin: aioredis.Redis, redis_server: str
) -> None:
    """Each round: a 30k gap, two replicas each place a 25k request at once; exactly one wins."""
    a, b = store_for(redis_server), store_for(redis_server)
    try:
        async with asyncio.timeout(BOUND_S):
            for round_ in range(40):
                name = f"n{round_}"
                await a.put_report(name, rep(30_000), ttl_s=60)
                wins = await asyncio.gather(
                    a.reserve(name, "from-a", 25_000, T0 + 1, 60),
                    b.reserve(name, "from-b", 25_000, T0 + 1, 60),
                )
                assert sorted(wins) == [False, True]
                assert len(await a.reservations(name, T0 + 1)) == 1
    finally:
        await a.close()
        await b.close()


async def test_concurrent_ceilings_keep_the_lowest(
    admin: aioredis.Redis, redis_server: str
) -> None:
    a, b = store_for(redis_server), store_for(redis_server)
    try:
        values = list(range(20_000, 30_000, 250))
        random.Random(3).shuffle(values)
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(
                *(
                    (a if i % 2 else b).set_ceiling("n1", v, T0, T0 + 30)
                    for i, v in enumerate(values)
                )
            )
        st = (await a.read(["n1"], T0 + 1))["n1"]
        assert st.flags.ceiling_tokens == 20_000
    finally:
        await a.close()
        await b.close()


# --- outside writers ----------------------------------------------------------------------------
def doc_example_commands(now: float) -> list[list[str]]:
    """The redis-cli commands of the documented push example, as argument lists."""
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"<!-- example:push -->\s*```sh\n(.*?)```", text, re.S)
    assert m, "docs/redis-schema.md lost its <!-- example:push --> block"
    cmds = []
    for line in m.group(1).splitlines():
        if line.startswith("redis-cli "):
            args = shlex.split(line.replace('"$NOW"', repr(now)))
            cmds.append(args[1:])
    return cmds


async def test_documented_push_example_is_read_back(
    admin: aioredis.Redis, redis_server: str
) -> None:
    now = time.time()
    cmds = doc_example_commands(now)
    assert [c[0] for c in cmds] == ["HSET", "PEXPIRE", "SADD"]
    for c in cmds:
        await admin.execute_command(*c)
    s = store_for(redis_server)
    try:
        st = (await s.read(["gpu-07"], now + 1))["gpu-07"]
        assert st.report == MemoryReport(
            capacity_tokens=120_000,
            free_tokens=45_600,
            largest_free_block_tokens=1_200,
            allocator="contiguous",
            block_size=1,
            running=14,
            waiting=2,
            started_at=1_712_000_000.0,
            reported_at=now,
        )
        assert (st.status, st.status_reason) == ("up", "")
        assert "gpu-07" in await s.known_backends()
        # The pushed block is what the atomic reserve checks against.
        assert not await s.reserve("gpu-07", "big", 1_201, now + 1, 60)
        assert await s.reserve("gpu-07", "fits", 1_200, now + 1, 60)
        assert 0 < await admin.pttl("kvroute:backend:{gpu-07}:state") <= 15_000
    finally:
        await s.close()


async def test_minimal_push_without_sadd(admin: aioredis.Redis, redis_server: str) -> None:
    await admin.hset(
        "kvroute:backend:{edge-1}:state",
        mapping={
            "capacity_tokens": "64000",
            "free_tokens": "9000.0",
            "largest_free_block_tokens": "8999.9",  # rounded down, in Python and in Lua alike
            "reported_at": "1700000000.5",
        },
    )
    s = store_for(redis_server)
    try:
        st = (await s.read(["edge-1"], T0 + 1))["edge-1"]
        assert st.status == "up"
        assert st.report == MemoryReport(64_000, 9_000, 8_999, reported_at=T0 + 0.5)
        assert await s.known_backends() == {"edge-1"}  # found by SCAN
        assert not await s.reserve("edge-1", "a", 9_000, T0 + 1, 60)
        assert await s.reserve("edge-1", "a", 8_999, T0 + 1, 60)
    finally:
        await s.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("largest_free_block_tokens", "lots"),
        ("largest_free_block_tokens", "0x10"),
        ("largest_free_block_tokens", "-5"),
        ("reported_at", "inf"),
        ("free_tokens", ""),
        ("allocator", "buddy"),
        ("block_size", "0"),
        ("queued_up_to_tokens", "-1"),
        ("queued_up_to_tokens", "many"),
    ],
)
async def test_malformed_push_reads_as_no_report(
    admin: aioredis.Redis, redis_server: str, field: str, value: str
) -> None:
    fields = {
        "capacity_tokens": "64000",
        "free_tokens": "9000",
        "largest_free_block_tokens": "100",
        "reported_at": "1700000000",
        field: value,
    }
    await admin.hset("kvroute:backend:{bad}:state", mapping=fields)
    s = store_for(redis_server)
    try:
        st = (await s.read(["bad"], T0))["bad"]
        assert st.report is None
        assert st.status == "unknown"
        assert field in st.status_reason
        # Lua agrees there is no report: nothing to check against, so the reserve is allowed.
        assert await s.reserve("bad", "r", 50_000, T0, 60)
    finally:
        await s.close()


async def test_wrong_type_key_spoils_only_its_backend(
    admin: aioredis.Redis, redis_server: str
) -> None:
    s = store_for(redis_server)
    try:
        await s.put_report("good", rep(10_000), ttl_s=60)
        await s.put_report("odd", rep(10_000), ttl_s=60)
        await admin.set("kvroute:backend:{odd}:flags", "not a hash")
        got = await s.read(["good", "odd"], T0)
        assert got["good"].report is not None and got["good"].status_reason == ""
        assert got["odd"].report is not None
        assert "flags key unreadable" in got["odd"].status_reason
        # A Redis error from a single-key call is StoreUnavailable, never a raw redis error.
        await admin.set("kvroute:events", "not a list")
        with pytest.raises(StoreUnavailable):
            await s.events()
    finally:
        await s.close()


# --- the key schema -------------------------------------------------------------------------------
async def test_keys_types_and_ttls_match_the_doc(admin: aioredis.Redis, redis_server: str) -> None:
    s = store_for(redis_server)
    try:
        await s.put_report("n1", rep(30_000), ttl_s=60)
        await s.reserve("n1", "r1", 1_000, T0, 900)
        await s.reserve("n1", "r2", 1_000, T0, 900)
        await s.forget("n1", "r2", T0 + 900)
        await s.set_draining("n1", True)
        await s.set_ceiling("n1", 5_000, T0, T0 + 30)
        await s.add_failed("req-9", "n1", ttl_s=300)
        await s.try_lock("restart", "gw-a", 30)
        await s.append_event({"kind": "restart"})
        expected = {
            "kvroute:backend:{n1}:state": ("hash", 60_000),
            "kvroute:backends": ("set", None),
            "kvroute:backend:{n1}:res": ("hash", 900_000 + 60_000),
            "kvroute:backend:{n1}:gone": ("zset", 900_000 + 60_000),
            "kvroute:backend:{n1}:flags": ("hash", None),
            "kvroute:retry:req-9": ("set", 300_000),
            "kvroute:lock:restart": ("string", 30_000),
            "kvroute:events": ("list", None),
        }
        assert set(await admin.keys("*")) == set(expected)
        for key, (kind, ttl_ms) in expected.items():
            assert await admin.type(key) == kind, key
            pttl = await admin.pttl(key)
            if ttl_ms is None:
                assert pttl == -1, key
            else:
                assert 0 < pttl <= ttl_ms, key
        assert await admin.hgetall("kvroute:backend:{n1}:res") == {
            "r1": f"1000 {T0!r} {T0 + 900!r}"
        }
        assert await admin.zrange("kvroute:backend:{n1}:gone", 0, -1, withscores=True) == [
            ("r2", T0 + 900)
        ]
        flags = await admin.hgetall("kvroute:backend:{n1}:flags")
        assert flags == {
            "draining": "1",
            "ceiling_tokens": "5000",
            "ceiling_set_at": repr(T0),
            "ceiling_until": repr(T0 + 30),
        }
        assert await admin.get("kvroute:lock:restart") == "gw-a"
    finally:
        await s.close()


async def test_key_prefix_is_honoured(admin: aioredis.Redis, redis_server: str) -> None:
    a = store_for(redis_server, key_prefix="acme")
    b = store_for(redis_server)  # default prefix: a separate namespace
    try:
        await a.put_report("n1", rep(1_000), ttl_s=60)
        await a.append_event({"k": 1})
        assert set(await admin.keys("*")) == {
            "acme:backend:{n1}:state",
            "acme:backends",
            "acme:events",
        }
        assert (await b.read(["n1"], T0))["n1"].report is None
        assert await b.known_backends() == set()
        assert await a.known_backends() == {"n1"}
    finally:
        await a.close()
        await b.close()


async def test_reservations_key_expiry_only_grows(admin: aioredis.Redis, redis_server: str) -> None:
    s = store_for(redis_server)
    try:
        await s.reserve("n1", "long", 1, T0, 3_600)
        await s.reserve("n1", "short", 1, T0, 1)
        assert await admin.pttl("kvroute:backend:{n1}:res") > 3_000_000
    finally:
        await s.close()


async def test_forgotten_ids_stay_out_of_the_reservations_hash(
    admin: aioredis.Redis, redis_server: str
) -> None:
    """Every reserve walks the reservations hash: forgotten ids go to the gone set instead.

    Cancelled and cut-off reserves each leave one for the reservation TTL (15 minutes); in
    the hash, thousands of them made every reserve cost milliseconds of Redis CPU
    (docs/redis-schema.md). In the gone set each is found by its id and pruned by its score.
    """
    s = store_for(redis_server)
    res, gone = "kvroute:backend:{n1}:res", "kvroute:backend:{n1}:gone"
    try:
        await s.put_report("n1", rep(30_000), ttl_s=60)
        assert await s.reserve("n1", "live", 1_000, T0, 900)
        for i in range(300):
            await s.forget("n1", f"cut-{i}", T0 + 10 + i % 2)
        assert await admin.hkeys(res) == ["live"]
        assert await admin.zcard(gone) == 300
        assert [r.id for r in (await s.read(["n1"], T0))["n1"].reservations] == ["live"]
        assert not await s.reserve("n1", "cut-7", 1_000, T0 + 5, 900)
        # A later until wins, an earlier one changes nothing.
        await s.forget("n1", "cut-8", T0 + 50)
        await s.forget("n1", "cut-8", T0 + 20)
        assert await admin.zscore(gone, "cut-8") == T0 + 50
        # The first reserve after they lapse prunes them; cut-8 is still refused.
        assert await s.reserve("n1", "next", 1_000, T0 + 10.5, 900)
        assert await admin.zcard(gone) == 151
        assert not await s.reserve("n1", "cut-8", 1_000, T0 + 12, 900)
        assert await s.reserve("n1", "cut-7", 1_000, T0 + 12, 900)
        assert await admin.zrange(gone, 0, -1) == ["cut-8"]
        assert sorted(await admin.hkeys(res)) == ["cut-7", "live", "next"]
    finally:
        await s.close()


async def test_an_older_versions_forgotten_ids_are_still_refused(
    admin: aioredis.Redis, redis_server: str
) -> None:
    """During a rolling upgrade, ``~<id>`` markers in the reservations hash still count."""
    s = store_for(redis_server)
    res = "kvroute:backend:{n1}:res"
    try:
        await s.put_report("n1", rep(30_000), ttl_s=60)
        await admin.hset(res, "~old", f"~ {T0 + 10!r}")
        assert not await s.reserve("n1", "old", 1_000, T0, 900)
        assert await s.reservations("n1", T0) == []
        assert await s.reserve("n1", "old", 1_000, T0 + 11, 900)
        assert await admin.hkeys(res) == ["old"]  # the lapsed marker was purged
    finally:
        await s.close()


async def test_read_is_one_round_trip(
    admin: aioredis.Redis, redis_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = store_for(redis_server)
    try:
        names = [f"n{i}" for i in range(25)]
        for n in names[:10]:
            await s.put_report(n, rep(5_000), ttl_s=60)
            await s.reserve(n, "r", 100, T0, 60)
        await s.read(names, T0)  # the connection and the script exist before counting
        sends = count_sends(monkeypatch)
        got = await s.read(names, T0 + 1)
        assert sends == [1]
        assert len(got) == 25 and sum(1 for st in got.values() if st.report is not None) == 10
    finally:
        await s.close()


async def test_scripts_come_back_after_script_flush(
    admin: aioredis.Redis, redis_server: str
) -> None:
    s = store_for(redis_server)
    try:
        await s.put_report("n1", rep(10_000), ttl_s=60)
        assert await s.reserve("n1", "a", 6_000, T0, 60)
        await admin.script_flush()
        assert not await s.reserve("n1", "b", 6_000, T0, 60)  # EVALSHA -> NOSCRIPT -> reloaded
        assert await s.try_lock("l", "me", 10)
        await s.set_ceiling("n1", 9_000, T0, T0 + 30)
        await admin.script_flush()
        await s.unlock("l", "me")
        assert await s.try_lock("l", "you", 10)
    finally:
        await s.close()


# --- the same rules as the in-process store, op for op ---------------------------------------------
async def test_redis_and_memory_agree_on_random_operations(
    admin: aioredis.Redis, redis_server: str
) -> None:
    """A seeded random mix of reports, reserves, releases and ceilings: identical answers."""
    red, mem = store_for(redis_server), InProcessStore()
    stores: list[StateStore] = [red, mem]
    rng = random.Random(20240611)
    names = ["a", "b", "c"]
    now = T0
    outcomes: set[bool] = set()
    try:
        for step in range(400):
            now += rng.choice([0.0, 0.05, 0.3, 1.0, 7.0])
            name = rng.choice(names)
            op = rng.random()
            if op < 0.2:
                largest = rng.randint(0, 40_000)
                r = rep(largest, reported_at=now - rng.choice([0.0, 0.2, 0.6, 3.0]))
                for s in stores:
                    await s.put_report(name, r, ttl_s=60)
            elif op < 0.7:
                args = (
                    name,
                    f"r{rng.randint(0, 40)}",
                    rng.randint(0, 15_000),
                    now,
                    rng.choice([2.0, 10.0, 60.0]),
                )
                kw = {
                    "check_fit": rng.random() < 0.9,
                    "headroom": rng.choice([0.0, 0.02, 0.1]),
                    "grace_s": rng.choice([0.0, 0.5]),
                }
                got = [await s.reserve(*args, **kw) for s in stores]  # type: ignore[arg-type]
                assert got[0] == got[1], (step, args, kw)
                outcomes.add(got[0])
            elif op < 0.8:
                rid = f"r{rng.randint(0, 40)}"
                for s in stores:
                    await s.release(name, rid)
            elif op < 0.87:
                rid = f"r{rng.randint(0, 40)}"
                until = now + rng.choice([-1.0, 0.0, 0.3, 5.0, 60.0])
                for s in stores:
                    await s.forget(name, rid, until)
            else:
                tokens = rng.randint(1_000, 30_000)
                until = now + rng.choice([1.0, 10.0, 30.0])
                for s in stores:
                    await s.set_ceiling(name, tokens, now, until)
            r_state = await red.read(names, now)
            assert r_state == await mem.read(names, now), step
            assert await red.reservations(name, now) == await mem.reservations(name, now), step
        assert outcomes == {True, False}  # the mix exercised both answers
    finally:
        await red.close()


# --- faults: a Redis that is stopped, frozen or restarted ------------------------------------------
# A deadline close to production's 100 ms, with room for a loaded CI machine on the calls
# that must succeed; the first call after recovery may take a few tries (never asserted fast).
FAULT_TIMEOUT_S = 0.25


async def eventually_ok(s: RedisStore) -> None:
    """Wait (bounded) until the store answers again, without recreating it."""
    for _ in range(100):
        if await s.ping():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the store did not recover by itself")


@pytest.fixture
def instance() -> Any:
    inst = RedisInstance()
    inst.start()
    try:
        yield inst
    finally:
        inst.close()


async def every_call_fails(s: RedisStore) -> None:
    calls = [
        s.read(["n1", "n2"], T0),
        s.put_report("n1", rep(1_000), ttl_s=60),
        s.mark_down("n1", "x", ttl_s=60),
        s.reserve("n1", "r", 10, T0, 60),
        s.release("n1", "r"),
        s.reservations("n1", T0),
        s.set_ceiling("n1", 10, T0, T0 + 1),
        s.set_draining("n1", True),
        s.add_failed("k", "n1", ttl_s=60),
        s.failed_on("k"),
        s.try_lock("l", "me", 10),
        s.unlock("l", "me"),
        s.append_event({"a": 1}),
        s.events(),
        s.known_backends(),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable):
            await call
    assert await s.ping() is False


async def test_stopped_redis_raises_store_unavailable_then_recovers(
    instance: RedisInstance,
) -> None:
    s = RedisStore(StoreConfig(redis_url=instance.url, op_timeout_s=FAULT_TIMEOUT_S))
    try:
        async with asyncio.timeout(BOUND_S):
            await s.put_report("n1", rep(30_000), ttl_s=60)
            instance.stop()
            await every_call_fails(s)
            instance.restart()  # same port, empty
            await eventually_ok(s)
            await s.put_report("n1", rep(30_000), ttl_s=60)
            assert await s.reserve("n1", "r", 25_000, T0, 60)  # scripts reloaded by themselves
            assert not await s.reserve("n1", "r2", 25_000, T0, 60)
            assert (await s.read(["n1"], T0))["n1"].report is not None
    finally:
        await s.close()


async def test_store_idle_across_a_restart_works_on_first_call(instance: RedisInstance) -> None:
    """Pooled connections to the old process are replaced without a failed call."""
    s = store_for(instance.url)  # a generous deadline: this is about stale pooled connections
    try:
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*(s.put_report(f"n{i}", rep(1_000), ttl_s=60) for i in range(8)))
            instance.restart()
            await s.put_report("n1", rep(2_000), ttl_s=60)
            got = await s.read(["n1", "n2"], T0)
            assert got["n1"].report is not None and got["n2"].report is None
    finally:
        await s.close()


async def test_frozen_redis_raises_store_unavailable_then_recovers(instance: RedisInstance) -> None:
    s = RedisStore(StoreConfig(redis_url=instance.url, op_timeout_s=FAULT_TIMEOUT_S))
    try:
        async with asyncio.timeout(BOUND_S):
            await s.put_report("n1", rep(30_000), ttl_s=60)
            instance.pause()  # SIGSTOP: connects, never answers
            try:
                with pytest.raises(StoreUnavailable):
                    await s.read(["n1"], T0)
                with pytest.raises(StoreUnavailable):
                    await s.reserve("n1", "r", 1, T0, 60)
                assert await s.ping() is False
            finally:
                instance.resume()
            await eventually_ok(s)
            assert await s.reserve("n1", "r", 25_000, T0, 60)
            assert (await s.read(["n1"], T0))["n1"].report is not None
    finally:
        await s.close()


async def test_a_late_reply_is_never_read_as_a_later_calls_answer(instance: RedisInstance) -> None:
    """The request path's lean lane (redis_lane.py) drops a connection whose command timed
    out: once Redis resumes it runs the frozen reserve and sends its "1", and a reused
    connection would hand that to the next reserve, which must be refused."""
    s = RedisStore(StoreConfig(redis_url=instance.url, op_timeout_s=FAULT_TIMEOUT_S))
    try:
        async with asyncio.timeout(BOUND_S):
            await s.put_report("n1", rep(1_000), ttl_s=60)
            assert await s.reserve("n1", "warm", 1, T0, 60)  # a lane connection exists
            await s.release("n1", "warm")
            instance.pause()
            try:
                with pytest.raises(StoreUnavailable):
                    await s.reserve("n1", "frozen", 10, T0, 60)
            finally:
                instance.resume()
            await eventually_ok(s)
            await asyncio.sleep(0.05)  # the frozen calls' replies are on their way by now
            assert not await s.reserve("n1", "too-big", 5_000, T0, 60)
            assert await s.reserve("n1", "fits", 10, T0, 60)
            assert await s.release_many([("n1", "frozen"), ("n1", "fits")]) is None
            assert [r.id for r in await s.reservations("n1", T0)] == []
    finally:
        await s.close()


async def test_calls_cut_off_by_the_deadline_keep_their_connections(
    instance: RedisInstance,
) -> None:
    """A call cancelled after its command was written keeps its connection: the lane reads
    the late reply and drops it, then reuses the connection. Closing each one, as the lane
    did, made every call after a slow moment open a connection (a handshake of its own, on a
    loop already too slow for the deadline): 484-642 connections for a minute's tiny
    requests at 64 connections with Redis paused three times 0.3 s, against 84 now."""
    s = RedisStore(StoreConfig(redis_url=instance.url, op_timeout_s=FAULT_TIMEOUT_S))
    admin = aioredis.Redis.from_url(instance.url, decode_responses=True)

    async def connections_made() -> int:
        return int((await admin.info("stats"))["total_connections_received"])

    try:
        async with asyncio.timeout(BOUND_S):
            await s.put_report("n1", rep(100_000), ttl_s=60)
            ids = [f"warm{i}" for i in range(8)]
            assert all(await asyncio.gather(*(s.reserve("n1", r, 1, T0, 60) for r in ids)))
            await s.release_many([("n1", r) for r in ids])
            instance.pause()
            try:
                frozen = [s.reserve("n1", f"frozen{i}", 1, T0, 60) for i in range(8)]
                for outcome in await asyncio.gather(*frozen, return_exceptions=True):
                    assert isinstance(outcome, StoreUnavailable)
            finally:
                instance.resume()
            await eventually_ok(s)
            await asyncio.sleep(0.2)  # the late replies are read by now
            before = await connections_made()
            later = [s.reserve("n1", f"later{i}", 1, T0, 60) for i in range(8)]
            assert all(await asyncio.gather(*later))
            assert await connections_made() == before  # every one reused, none opened
            # Each late "1" was read and dropped, none taken as a later call's answer.
            assert not await s.reserve("n1", "too-big", 100_000, T0, 60)
            assert await s.reserve("n1", "fits", 10, T0, 60)
    finally:
        await admin.aclose()
        await s.close()


async def test_release_many_releases_every_pair_and_keeps_the_lane_in_step(
    admin: aioredis.Redis, redis_server: str
) -> None:
    s = store_for(redis_server)
    try:
        pairs = [(f"n{i % 3}", f"r{i}") for i in range(10)]
        for name, rid in pairs:
            assert await s.reserve(name, rid, 1, T0, 60, check_fit=False)
        await s.release_many(pairs[:7])
        left = {r.id for n in ("n0", "n1", "n2") for r in await s.reservations(n, T0)}
        assert left == {"r7", "r8", "r9"}
        # Ten replies were read for ten commands: the next answers are the next calls'.
        await s.put_report("n0", rep(100), ttl_s=60)
        assert not await s.reserve("n0", "big", 1_000, T0, 60)
        assert await s.reserve("n0", "small", 1, T0, 60)
    finally:
        await s.close()


async def test_unreachable_url_raises_store_unavailable() -> None:
    from tests.support.redis_server import free_port

    s = RedisStore(StoreConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    try:
        async with asyncio.timeout(BOUND_S):
            await every_call_fails(s)
    finally:
        await s.close()


def test_redis_store_needs_a_url() -> None:
    with pytest.raises(ValueError):
        RedisStore(StoreConfig())


async def test_new_connections_do_not_read_the_package_metadata(
    redis_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py 7+ looks its version up in the package metadata for every new connection
    # unless given it; connections are made whenever one is dropped with a command in flight.
    import redis.utils

    lookups = 0
    original = redis.utils.get_lib_version

    def counting() -> str:
        nonlocal lookups
        lookups += 1
        return str(original())

    s = store_for(redis_server)
    try:
        monkeypatch.setattr(redis.utils, "get_lib_version", counting)
        await s.put_report("n", rep(1_000_000), ttl_s=60)
        # Concurrent calls: the request path's lane opens a connection for each.
        got = await asyncio.gather(*(s.reserve("n", f"r{i}", 10, T0, 60) for i in range(12)))
        await s.read(["n"], T0)
        assert all(got)
        assert lookups == 0
    finally:
        await s.close()


async def test_a_reply_held_up_by_the_gateways_own_busy_loop_is_not_an_outage(
    redis_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Big prompts can hold the event loop for longer than the deadline; Redis answered long
    # before. The call must succeed at once, not time out, retry and tombstone the id.
    s = store_for(redis_server, op_timeout_s=0.05)
    try:
        await s.put_report("n", rep(1_000_000), ttl_s=60)
        await s.reserve("n", "warm", 10, T0, 60)  # the connection and the script exist
        sends = count_sends(monkeypatch)
        task = asyncio.ensure_future(s.reserve("n", "r1", 10, T0, 60))
        await asyncio.sleep(0)  # sent
        hold_the_loop(0.3)  # the loop is busy elsewhere, past the deadline
        assert await task is True
        assert sends == [1]  # answered the first time: no timeout, no retry
    finally:
        await s.close()
