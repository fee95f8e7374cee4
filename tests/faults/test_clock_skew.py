"""Gateway replicas with shifted clocks (libfaketime) share one Redis and still route right.

Real processes: redis-server, one engine of 20,000 tokens, gateway A on the true clock
(it starts first, so its collector holds the scrape lock and stamps the reports), and two
more replicas started under ``faketime``: B 10 s ahead, C 10 s behind.
Measured before one clock: a replica 10 s ahead served nothing (every report looked 10 s
old, so stale); one behind made reservations that looked older than the last report, so
they counted as already visible in it and a second 12,700-token request was let into the
same 20,000-token gap (and one ahead purged the other's reservations as expired). Now every
replica measures its offset to Redis ``TIME`` and stamps shared times on Redis's clock.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator

import httpx
import pytest

from loadtest.local_fleet import EngineSpec, Proc, free_port, wait_http
from loadtest.workload import make_prompt
from tests.faults.harness import RESULTS, FaultFleet, body, new_client, record, run_load
from tests.support.faketime import leftovers_removed, shifted_env

pytestmark = pytest.mark.faults

CAPACITY = 20_000
# 12,000 prompt + 700 new tokens: one fits in 20,000 tokens, two do not; ~1.5 s at 10x speed.
BIG_PROMPT = make_prompt(12_000)
BIG_NEW = 700


def start_shifted(fleet: FaultFleet, shift: str) -> Proc:
    """One more gateway replica, its clock shifted by libfaketime (preloaded, ``+10s``)."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve"]
    argv += ["--config", str(fleet.config_path), "--port", str(port), "--log-level", "warning"]
    env = shifted_env(shift, {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")})
    g = Proc(f"gateway-shifted{shift}", argv, f"http://127.0.0.1:{port}")
    g.start(env=env, log_dir=fleet.workdir)
    fleet.gateways.append(g)  # stopped with the fleet
    wait_http(g.url + "/health", timeout_s=40, proc=g.popen)
    return g


@pytest.fixture(scope="module")
def skewed() -> Iterator[tuple[FaultFleet, str, str]]:
    f = FaultFleet(n_engines=1, queue={"max_wait_s": 15.0})
    f.specs = [EngineSpec(name="e0", speedup=10.0, capacity_tokens=CAPACITY)]
    with leftovers_removed():
        try:
            f.start()
            ahead = start_shifted(f, "+10s").url
            behind = start_shifted(f, "-10s").url
        except BaseException:
            f.stop()
            raise
        try:
            yield f, ahead, behind
        finally:
            f.stop()


def test_replicas_with_shifted_clocks_serve(skewed: tuple[FaultFleet, str, str]) -> None:
    fleet, ahead, behind = skewed
    for url in (ahead, behind):
        fleet.wait_ready(url)
        tally = asyncio.run(run_load(url, 2.0, workers=4))
        record(RESULTS, f"clock {'+10 s' if url == ahead else '-10 s'}", tally)
        assert tally.sent > 0 and tally.ok == tally.sent, tally.summary()
        ages = [b["report"]["age_s"] for b in fleet.fleet_state(url)["backends"]]
        # Seen on Redis's clock: the report is fresh (scrape interval 0.25 s), not 10 s off.
        assert all(-1.0 < a < 2.0 for a in ages), ages


async def two_big(first: str, second: str) -> list[tuple[int, str, str]]:
    """A 12,700-token request on one replica, then another on a second one, 0.1 s later."""
    async with new_client() as client:

        async def one(url: str, delay: float) -> tuple[int, str, str]:
            await asyncio.sleep(delay)
            req = body(stream=False, max_tokens=BIG_NEW, prompt=BIG_PROMPT)
            resp = await client.post(url + "/v1/chat/completions", json=req)
            attempts = resp.headers.get("x-kvroute-attempts", "")
            return resp.status_code, attempts, resp.text[:200]

        return list(await asyncio.gather(one(first, 0.0), one(second, 0.1)))


@pytest.mark.parametrize("order", ["behind_then_true", "true_then_ahead"])
def test_shifted_replica_never_overcommits(skewed: tuple[FaultFleet, str, str], order: str) -> None:
    """Two requests that cannot share the node: the second waits for the first, on any clock."""
    fleet, ahead, behind = skewed
    for url in (fleet.url, ahead, behind):
        fleet.wait_ready(url)
    first, second = (behind, fleet.url) if order == "behind_then_true" else (fleet.url, ahead)
    before = httpx.get(fleet.engine_url(0) + "/metrics", timeout=5).text
    answers = asyncio.run(two_big(first, second))
    after = httpx.get(fleet.engine_url(0) + "/metrics", timeout=5).text
    # Over-committed, the engine refuses the second allocation: a failed attempt or a 503.
    assert [(s, a) for s, a, _ in answers] == [(200, "1"), (200, "1")], (answers, before, after)
    fleet.assert_no_reservations()
