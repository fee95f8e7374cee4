"""Redis frozen (SIGSTOP) or killed for 15 s under steady traffic: the gateway keeps routing well.

Real processes: a redis-server, four simulated engines and one gateway. Three engines hold
8,000 tokens, one 100,000, so a long request (about 9,000 tokens) fits on one node only.
Measured before degraded mode: 934 of 937 requests went to one engine (every request
ranked on one frozen snapshot, then by length only, which sorts by name), and long requests
failed on the small nodes. Now each replica scrapes and reserves locally while Redis is
away: at least 99% are served, no engine takes more than half of the outage's requests,
every long request gets the big node, and nothing stays reserved once Redis is back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from loadtest.local_fleet import EngineSpec
from loadtest.workload import make_prompt
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

OUTAGE_S = 15.0
LONG_PROMPT = make_prompt(13_000)  # long (> 8,000 tokens) and too big for a small node
SMALL, BIG = 12_000, 100_000


@pytest.fixture(scope="module")
def fleet4() -> Iterator[FaultFleet]:
    f = FaultFleet(n_engines=4)
    f.specs = [
        EngineSpec(name=f"e{i}", speedup=10.0, capacity_tokens=BIG if i == 3 else SMALL)
        for i in range(4)
    ]
    try:
        f.start()
    except BaseException:
        f.stop()
        raise
    try:
        yield f
    finally:
        f.stop()


@dataclass
class Outage:
    """Every request of the run, and which ones started while Redis was away."""

    began: float = 0.0
    ended: float = float("inf")
    tally: Tally = field(default_factory=Tally)
    during: Counter[str] = field(default_factory=Counter)
    long_during: list[tuple[str, str]] = field(default_factory=list)

    @property
    def during_total(self) -> int:
        return sum(self.during.values())


async def steady_load(url: str, seconds: float, out: Outage, workers: int = 8) -> None:
    """Closed loop: seven workers send short requests (half streamed), one sends long ones."""
    stop_at = time.monotonic() + seconds
    async with new_client(workers * 2) as client:

        async def worker(w: int) -> None:
            i = 0
            while time.monotonic() < stop_at:
                long = w == 0
                req = (
                    body(stream=False, max_tokens=16, prompt=LONG_PROMPT)
                    if long
                    else body(stream=(w + i) % 2 == 0)
                )
                started = time.monotonic()
                bucket, detail, backend = await send(client, url, req)
                out.tally.add(bucket, detail, backend)
                if out.began <= started < out.ended:
                    out.during[backend or f"({bucket})"] += 1
                    if long:
                        out.long_during.append((bucket, backend or detail))
                i += 1

        await asyncio.gather(*(worker(w) for w in range(workers)))


def run_outage(fleet: FaultFleet, stop: Callable[[], None], start: Callable[[], None]) -> Outage:
    out = Outage()

    async def scenario() -> None:
        load = asyncio.create_task(steady_load(fleet.url, OUTAGE_S + 3.0, out))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stop)
        out.began = time.monotonic()
        await asyncio.sleep(OUTAGE_S)
        out.ended = time.monotonic()
        # On this thread: redis-server dies with the thread that started it (PR_SET_PDEATHSIG).
        start()
        await load

    asyncio.run(scenario())
    return out


def check(fleet: FaultFleet, name: str, out: Outage) -> None:
    t = out.tally
    record(
        RESULTS,
        name,
        t,
        during=dict(out.during),
        long_during=len(out.long_during),
    )
    assert t.ok >= 0.99 * t.sent, t.summary()
    assert out.during_total > 50, out.during
    top, count = out.during.most_common(1)[0]
    assert count <= out.during_total / 2, f"{top} took {count} of {out.during_total}: {out.during}"
    assert out.long_during, "no long request was made during the outage"
    bad = [x for x in out.long_during if x != ("ok", "e3")]
    assert not bad, f"long requests that fit on e3 only: {bad[:5]} of {len(out.long_during)}"
    wait_for(lambda: not fleet.fleet_state()["degraded"], 20, "the gateway to leave degraded mode")
    fleet.heal()
    # Reservations made while Redis was away end (or were re-registered and then released).
    fleet.assert_no_reservations()


def test_redis_frozen_15s_keeps_routing_fit_aware_and_spread(fleet4: FaultFleet) -> None:
    fleet4.heal()
    out = run_outage(fleet4, fleet4.redis.pause, fleet4.redis.resume)
    check(fleet4, "degraded: redis frozen 15 s", out)


def test_redis_killed_15s_keeps_routing_fit_aware_and_spread(fleet4: FaultFleet) -> None:
    fleet4.heal()
    out = run_outage(fleet4, fleet4.kill_redis, fleet4.restart_redis)
    check(fleet4, "degraded: redis killed 15 s", out)


def test_frozen_snapshot_nodes_do_not_turn_stale(fleet4: FaultFleet) -> None:
    """Past collector.stale_after_s into an outage, a request that fits is served, not 503."""
    fleet4.heal()
    stale_after = 2.0  # harness fault_config
    fleet4.redis.pause()
    try:
        time.sleep(stale_after * 2.5)

        async def probe() -> list[tuple[str, str, str]]:
            async with new_client() as client:
                return [await send(client, fleet4.url, body(stream=False)) for _ in range(8)]

        answers = asyncio.run(probe())
        state: dict[str, Any] = fleet4.fleet_state()
    finally:
        fleet4.redis.resume()
    assert all(a[0] == "ok" for a in answers), answers
    ages = [b["report"]["age_s"] for b in state["backends"] if b["report"]]
    assert state["degraded"] and len(ages) == 4 and max(ages) < stale_after, state
