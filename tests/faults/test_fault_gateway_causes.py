"""Fault scenarios of the gateway's own answers, against real processes (issue 9).

One fleet for the module: redis-server, four engines and a gateway, all subprocesses (the
suite's ``FaultFleet``). Scenarios: a burst of 24 short requests to 4 idle engines spreads
(none gets more than 12); a client that leaves a non-streamed request gets it cancelled at
the engine within 2 s (the engine would have worked on it for 10 s) and its reservation
released; every engine down is answered at once with 503 ``cause: unavailable`` and no
``scale_up`` advice, and the gateway recovers by itself when the engines come back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.faults.harness import (
    RESULTS,
    FaultFleet,
    Tally,
    body,
    new_client,
    record,
    recovered,
    send,
    wait_for,
)

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def fleet4() -> Iterator[FaultFleet]:
    # A long queue wait, so that an outage answered "at once" is told apart from one that waited.
    f = FaultFleet(n_engines=4, queue={"max_wait_s": 10.0})
    try:
        f.start()
    except BaseException:
        f.stop()
        raise
    try:
        yield f
    finally:
        f.stop()


def engine_state(fleet: FaultFleet, i: int) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(fleet.engine_url(i) + "/admin/state", timeout=5).json()
    return data


def test_fault_burst_spreads_over_idle_engines(fleet4: FaultFleet) -> None:
    fleet4.heal()

    async def burst() -> Tally:
        tally = Tally()
        async with new_client(48) as client:
            # 600 tokens at 500/s: each request lives ~1.2 s, the whole burst overlaps.
            answers = await asyncio.gather(
                *(send(client, fleet4.url, body(stream=False, max_tokens=600)) for _ in range(24))
            )
        for bucket, detail, backend in answers:
            tally.add(bucket, detail, backend)
        return tally

    tally = asyncio.run(burst())
    record(RESULTS, "burst of 24 to 4 idle engines", tally, spread=dict(tally.backends))
    assert tally.ok == 24, tally.summary()
    assert max(tally.backends.values()) <= 12, tally.backends
    fleet4.assert_no_reservations()


def test_fault_client_leaves_a_non_streamed_request(fleet4: FaultFleet) -> None:
    fleet4.heal()
    before = Counter({i: engine_state(fleet4, i)["outcomes"]["cancelled"] for i in range(4)})
    # 5000 tokens at 500/s: the engine would work on it for 10 s.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            fleet4.url + "/v1/chat/completions", json=body(False, max_tokens=5_000), timeout=0.5
        )
    left = time.monotonic()

    def cancelled() -> bool:
        return sum(engine_state(fleet4, i)["outcomes"]["cancelled"] for i in range(4)) > sum(
            before.values()
        )

    wait_for(cancelled, 2.0, "the engine to see the request cancelled", interval_s=0.05)
    took = time.monotonic() - left
    record(RESULTS, "client leaves (non-streamed)", Tally(), cancelled_after_s=round(took, 2))
    # Not retried elsewhere either: nothing runs anywhere, nothing stays reserved.
    assert all(engine_state(fleet4, i)["running"] == 0 for i in range(4))
    fleet4.assert_no_reservations(timeout_s=2.0)


def test_fault_every_backend_down(fleet4: FaultFleet) -> None:
    fleet4.heal()
    for i in range(4):
        fleet4.kill_engine(i)
    wait_for(
        lambda: not any(b["up"] for b in fleet4.fleet_state()["backends"]),
        15.0,
        "the collector to mark every engine down",
    )

    async def load() -> tuple[Tally, list[float]]:
        tally, took = Tally(), []
        async with new_client() as client:
            for i in range(6):
                started = time.monotonic()
                tally.add(*await send(client, fleet4.url, body(stream=i % 2 == 0)))
                took.append(time.monotonic() - started)
        return tally, took

    tally, took = asyncio.run(load())
    r = httpx.post(fleet4.url + "/v1/chat/completions", json=body(False), timeout=30)
    advice = httpx.get(fleet4.url + "/fleet/advice", timeout=5).json()
    record(RESULTS, "every backend down", tally, slowest_s=round(max(took), 2))
    assert tally.failed == tally.sent and tally.lost == 0, tally.summary()
    assert set(tally.failed_codes) == {"503:no_backend_available"}, tally.failed_codes
    err = r.json()["error"]
    assert err["cause"] == "unavailable" and err["backends_reachable"] == 0, err
    # Answered at once: the admission queue would have held each one for 10 s.
    assert max(took) < 2.0, took
    assert advice["action"] != "scale_up", advice
    after = asyncio.run(recovered_when_back(fleet4))
    assert after.ok == after.sent, after.summary()
    fleet4.assert_no_reservations()


async def recovered_when_back(fleet: FaultFleet) -> Tally:
    await asyncio.to_thread(fleet.heal)
    return await recovered(fleet.url)
