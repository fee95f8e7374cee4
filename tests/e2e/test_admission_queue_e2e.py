"""The admission queue end to end: how long a request waits, the bound, and letting one through.

A real engine is checkerboarded so that no long request fits; the gateway (real app on
uvicorn) then queues the long request. Times are wall-clock, with margins that a slow
machine cannot cross and that a wrong deadline (10 x ``max_wait_s``) or a missing wait cannot
meet either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from tests.e2e.test_gateway_e2e import LONG, backend, chat, wait_reports
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

HOLE = 4_000


def checkerboard(engine: Any) -> list[str]:
    """Hold the whole cache in HOLE-sized regions and free every other one; returns the rest."""
    cap = int(engine.state()["capacity_tokens"])
    ids: list[str] = engine.hold(HOLE, cap // HOLE)
    engine.release(ids[0::2])
    return ids[1::2]


def wait_fragmented(url: str) -> None:
    wait_until(
        lambda: all(
            (b["report"] or {}).get("largest_free_block_tokens", 1e9) <= HOLE
            for b in fleet_state(url)["backends"]
        ),
        what="the fragmented report",
    )


def test_queued_request_gets_503_after_max_wait_not_much_later(
    engine_factory: Callable[..., Any],
) -> None:
    e = engine_factory(name="q1")
    checkerboard(e)
    max_wait = 2.0
    with run_gateway(gateway_cfg([backend(e)], queue={"max_wait_s": max_wait})) as url:
        wait_reports(url, 1)
        wait_fragmented(url)
        t0 = time.monotonic()
        r = chat(url, LONG)
        elapsed = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert r.json()["error"]["cause"] == "fragmentation"
    # It waited (at least max_wait_s) and gave up on time: within 1.5 x max_wait_s, a full
    # second of slack for the request's own work (tokenizing, one HTTP round trip: ~0.1 s).
    assert max_wait <= elapsed <= 1.5 * max_wait, elapsed


def test_full_queue_answers_503_at_once_and_a_waiter_gets_through_when_memory_frees(
    engine_factory: Callable[..., Any],
) -> None:
    e = engine_factory(name="q2")
    held = checkerboard(e)
    max_wait = 30.0  # the waiter may wait long; the second request must not wait at all
    cfg = gateway_cfg([backend(e)], queue={"max_wait_s": max_wait, "max_size": 1})
    with run_gateway(cfg) as url:
        wait_reports(url, 1)
        wait_fragmented(url)
        waiter: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: waiter.setdefault("r", chat(url, LONG)), daemon=True)
        t.start()
        wait_until(lambda: fleet_state(url)["queue_depth"] == 1, what="the first request queued")

        t0 = time.monotonic()
        second = chat(url, LONG)
        elapsed = time.monotonic() - t0
        assert second.status_code == 503, second.text
        assert elapsed < max_wait / 10, elapsed  # answered at once, not after a wait
        assert t.is_alive() and fleet_state(url)["queue_depth"] == 1  # the waiter still waits

        e.release(held)  # memory frees: the next report shows a big block
        t.join(max_wait)
        assert not t.is_alive(), "the waiter was not let through"
        assert fleet_state(url)["queue_depth"] == 0
    r = waiter["r"]
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-backend"] == "q2"
