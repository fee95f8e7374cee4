"""Where requests go while Redis is down: spread over the fleet, long ones to the long pool.

Its own fleet (two general engines, two long-pool engines, one gateway; real processes):
Redis is killed, the gateway passes ``max_snapshot_age_s`` and routes by length only, and a
load of short and long requests runs. Every request is answered; this test checks where.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.harness import (
    RESULTS,
    FaultFleet,
    Tally,
    body,
    new_client,
    record,
    send,
    wait_for,
)

pytestmark = pytest.mark.faults

LONG_THRESHOLD = 500
SHORT_MAX_TOKENS = 24  # demand ~100 tokens: short
LONG_MAX_TOKENS = 600  # demand ~680 tokens: long
GENERAL = {"e0", "e1"}
LONG_POOL = {"e2", "e3"}


@pytest.fixture(scope="module")
def pooled() -> Iterator[FaultFleet]:
    f = FaultFleet(
        speedup=50.0,
        pools=["general", "general", "long", "long"],
        routing={"long_threshold_tokens": LONG_THRESHOLD},
    )
    try:
        f.start()
        yield f
    finally:
        f.stop()


async def mixed_load(url: str, rounds: int, workers: int = 8) -> tuple[Tally, Tally]:
    """``rounds`` per worker; every fourth request is long. Returns (shorts, longs)."""
    shorts, longs = Tally(), Tally()
    async with new_client(workers * 2) as client:

        async def worker(w: int) -> None:
            for i in range(rounds):
                long = (w + i) % 4 == 0
                req = body(
                    stream=i % 2 == 0, max_tokens=LONG_MAX_TOKENS if long else SHORT_MAX_TOKENS
                )
                bucket, detail, backend = await send(client, url, req)
                (longs if long else shorts).add(bucket, detail, backend)

        await asyncio.gather(*(worker(w) for w in range(workers)))
    return shorts, longs


def assert_long_pool(shorts: Tally, longs: Tally) -> None:
    assert shorts.ok == shorts.sent and longs.ok == longs.sent, (
        shorts.summary(),
        longs.summary(),
    )
    assert longs.sent > 0 and set(longs.backends) <= LONG_POOL, dict(longs.backends)


def assert_spread(shorts: Tally) -> None:
    # Every general node takes at least a tenth of the short requests (pinned to one node, as
    # length-only routing does today, the other takes none; with Redis up each takes ~35%).
    shares = {name: shorts.backends.get(name, 0) / shorts.ok for name in sorted(GENERAL)}
    assert min(shares.values()) >= 0.1, dict(shorts.backends)


def test_placement_with_redis_up_is_spread(pooled: FaultFleet) -> None:
    """The same load and assertions with Redis up: what the outage tests are measured against."""
    shorts, longs = asyncio.run(mixed_load(pooled.url, 12))
    record(
        RESULTS,
        "placement, redis up",
        shorts,
        longs=dict(longs.backends),
        shorts_by=dict(shorts.backends),
    )
    assert_long_pool(shorts, longs)
    assert_spread(shorts)
    pooled.assert_no_reservations()


@pytest.fixture(scope="module")
def during_outage(pooled: FaultFleet) -> tuple[Tally, Tally]:
    """One load run while Redis is down (past max_snapshot_age_s: length only): (shorts, longs)."""
    pooled.heal()
    pooled.kill_redis()
    try:
        wait_for(
            lambda: httpx.get(pooled.url + "/health", timeout=5).json()["store"] == "unreachable",
            10,
            "the gateway to see Redis down",
        )
        time.sleep(1.5)  # past max_snapshot_age_s (1 s in the suite): no memory figures left
        shorts, longs = asyncio.run(mixed_load(pooled.url, 12))
        record(
            RESULTS,
            "placement, redis down",
            shorts,
            longs=dict(longs.backends),
            shorts_by=dict(shorts.backends),
        )
    finally:
        pooled.heal()
    return shorts, longs


def test_long_requests_still_go_to_the_long_pool_while_redis_is_down(
    during_outage: tuple[Tally, Tally],
) -> None:
    assert_long_pool(*during_outage)


def test_placement_while_redis_is_down_is_spread(during_outage: tuple[Tally, Tally]) -> None:
    assert_spread(during_outage[0])
