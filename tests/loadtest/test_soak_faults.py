"""The fault soak's report (loadtest.bench.soak_faults): what a window says, read without a fleet."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any
from unittest.mock import patch

import redis

from loadtest.bench.soak_faults import FAULTS, Window, fault_cycle, percentile, window_json
from loadtest.bench.soak_quiet import lease_owner, quiet_moment
from loadtest.bench.soak_redis import live_reserved
from loadtest.local_fleet import Proc


def test_ttft_percentiles_leave_out_the_30_s_after_each_fault() -> None:
    w = Window(answered=5, failures=Counter({"killed_replica": 2}), faults=["60s replica"])
    # Sent at 10, 20 (calm), 65 and 89 (within 30 s of the fault at 60), 95 (calm again).
    w.ttft = [(10.0, 0.1), (20.0, 0.2), (65.0, 9.0), (89.0, 8.0), (95.0, 0.3)]
    got = window_json(w, fault_times=[60.0])
    assert got["ttft_samples_outside_faults"] == 3
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (0.2, 0.3)
    assert got["failures"] == {"killed_replica": 2} and got["answered"] == 5


def test_percentile_and_the_fault_cycle() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(100)], 0.99) == 99.0
    assert FAULTS == ("replica", "redis", "engine", "reload", "disconnects")


def test_the_redis_fault_is_named_for_the_topology() -> None:
    assert fault_cycle("failover") == ["replica", "failover", "engine", "reload", "disconnects"]
    assert fault_cycle("redis")[1] == "redis"
    assert fault_cycle("failover", only="failover,replica") == ["replica", "failover"]
    assert fault_cycle("failover", only="redis") == fault_cycle("failover")  # none chosen: all


def test_redis_counts_what_the_reserve_script_counts(redis_server: str) -> None:
    """Unexpired reservations only, and of those under a lease only while the lease runs."""
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    prefix = "soaktest"
    now = float(r.time()[0])
    r.hset(f"{prefix}:backend:{{a}}:res", mapping={
        "r1@L1": f"100 {now} {now + 60}",  # live lease: counts
        "r2@L2": f"20 {now} {now + 60}",  # lapsed lease: no
        "r3": f"3 {now} {now + 60}",  # no lease: counts
        "r4": f"4000 {now - 90} {now - 30}",  # expired: no
        "~r5": "~ 0",  # an old forget marker: no
    })  # fmt: skip
    r.hset(f"{prefix}:backend:{{a}}:leases", mapping={"L1": now + 30, "L2": now - 1})
    r.hset(f"{prefix}:backend:{{b}}:res", mapping={"r6@L9": f"5000 {now} {now + 60}"})
    try:
        assert live_reserved(r, ["a"], prefix) == 103
        assert live_reserved(r, ["a", "b", "c"], prefix) == 103  # L9 was never registered
    finally:
        r.delete(*(f"{prefix}:backend:{{{n}}}:{k}" for n in "ab" for k in ("res", "leases")))


def test_a_quiet_moment_waits_for_the_requests_then_for_zero() -> None:
    class Store:
        kind, fault = "single", "redis"

        def client(self) -> None:
            return None

    reads = iter([700, 700, 0])

    async def go() -> dict[str, Any]:
        inflight = {asyncio.create_task(asyncio.sleep(0.2))}
        with patch("loadtest.bench.soak_quiet.live_reserved", lambda _c, _b: next(reads)):
            return await quiet_moment([], Store(), ["a"], inflight, lease_ttl_s=5.0)  # type: ignore[arg-type]

    q = asyncio.run(go())
    assert q["drain_s"] >= 0.2 and q["still_in_flight"] == 0
    assert q["at_quiet"] == {"redis": 700} and q["left"] is None
    assert q["zero_after_s"] is not None and q["within_lease_ttl"]


def test_a_lease_is_named_by_the_replica_whose_pid_it_carries() -> None:
    class Popen:
        pid = 4242

    r = Proc("replica-1", [], "http://x", popen=Popen())  # type: ignore[arg-type]
    assert lease_owner("vm-a-b-4242-3fe80c.2", [r]) == "replica-1"
    assert lease_owner("vm-4513-3fe80c.1", [r]) == "vm-4513-3fe80c.1"  # a replica gone since
    assert lease_owner("", [r]) == "(no lease)"
