"""Redis Sentinel failover under steady traffic through two gateway replicas.

Real processes: a Redis master, its replica and three ``redis-sentinel`` (quorum 2,
down-after 500 ms); two gateway replicas (uvicorn threads) sharing the store through
Sentinel; three simulated engines. The master is SIGKILLed while clients send requests
whose demand makes reservations matter (three at most fit on a node at once).

Asserted: at least 99% of requests served; no node over-committed once the new master is in
service (the engines' contiguous allocators refuse what does not fit, and none refuses a
request from then on, while more clients than fit keep asking); no reservation outlives its
TTL. The measured
failover window is printed and recorded in docs/reliability.md.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import httpx
import redis

from loadtest.workload import make_prompt
from proxy.config import parse_config
from tests.support.engines import start_engine, wait_until
from tests.support.gateway import run_gateway
from tests.support.redis_server import SentinelGroup

CAPACITY = 60_000
PROMPT_TOKENS = 15_000  # + max_tokens: three requests fit on a node, a fourth does not
RES_TTL_S = 4.0
# More clients than nodes x 3: without shared reservations nodes would be over-committed.
WORKERS = 12


def fleet(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/fleet", timeout=5).json())


class Load:
    """WORKERS client threads alternating between the gateways until stopped."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.stop = threading.Event()
        self.results: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self.body = {"model": "m", "prompt": make_prompt(PROMPT_TOKENS), "max_tokens": 32}
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(WORKERS)
        ]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=30) as c:
            n = i
            while not self.stop.is_set():
                url = self.urls[n % len(self.urls)] + "/v1/completions"
                n += 1
                try:
                    status = c.post(url, json=self.body).status_code
                except httpx.HTTPError:
                    status = 0
                with self.lock:
                    self.results.append((time.monotonic(), status))
                time.sleep(0.02)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)


def live_reservations(r: redis.Redis, names: list[str], now: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        total = 0
        for rid, value in r.hgetall(f"kvroute:backend:{{{n}}}:res").items():
            if rid.startswith("~"):
                continue  # a "forget" marker (a released id whose late reserve is refused)
            tokens, _created, expires = value.split(" ")
            if float(expires) > now:
                total += int(tokens)
        out[n] = total
    return out


def full_nodes(peak: Counter[str]) -> int:
    """Nodes seen holding three reservations at once (all that fit)."""
    return sum(1 for tokens in peak.values() if tokens >= 3 * PROMPT_TOKENS)


def test_sentinel_failover_under_traffic() -> None:
    group = SentinelGroup(sentinels=3, down_after_ms=500).start()
    # Engines as processes: their tokenizing does not compete with the gateways for the GIL.
    engines = [
        start_engine("process", name=f"n{i}", capacity_tokens=CAPACITY, speedup=20.0)
        for i in range(3)
    ]
    try:
        cfg = parse_config(
            {
                "backends": [{"name": e.name, "url": e.url, "kind": "contiguous"} for e in engines],
                "store": {
                    "sentinel": {"master": group.name, "nodes": group.nodes},
                    "reservation_ttl_s": RES_TTL_S,
                    # A reservation counts against reports up to this long after it: longer
                    # than a 15k-token prompt's trip to the engine's allocator on this
                    # crowded 2-core machine (two gateways, three engines, Redis, sentinels).
                    "report_grace_s": 1.0,
                },
                "collector": {"scrape_interval_s": 0.2, "stale_after_s": 3.0},
                "queue": {"max_wait_s": 10.0},
                # The engines serve "sim-model"; the clients send "m" (model routing: 404).
                "routing": {"unknown_model": "pass_through"},
            },
            environ={},
        )
        names = [e.name for e in engines]
        with run_gateway(cfg) as g1, run_gateway(cfg) as g2:
            for url in (g1, g2):
                wait_until(
                    lambda u=url: all(b["report"] for b in fleet(u)["backends"]), 15, "reports"
                )
            with Load([g1, g2]) as load:
                time.sleep(2.0)
                old_port = group.master.port
                assert group.master.proc is not None
                failures_at_kill = {
                    e.name: e.state()["lifetime_allocation_failures"] for e in engines
                }
                t_kill = time.monotonic()
                group.master.proc.kill()  # SIGKILL: no goodbye to clients or sentinels
                wait_until(lambda: group.master_port() == group.replica.port, 20, "promotion")
                t_promoted = time.monotonic()
                wait_until(
                    lambda: all(not fleet(u)["degraded"] for u in (g1, g2)), 20, "gateways back"
                )
                t_back = time.monotonic()
                failures_at_back = {
                    e.name: e.state()["lifetime_allocation_failures"] for e in engines
                }
                new = redis.Redis(port=group.replica.port, decode_responses=True)
                peak: Counter[str] = Counter()
                # Sample for 3 s at least, and on until two nodes have been seen full: on a
                # crowded CI box fewer requests sit at the engines at once, and a fixed 3 s
                # of 50 ms snapshots once caught only one full node (CI flake). The load
                # runs all the while, so a longer window also checks over-commit for longer.
                t_sample = time.monotonic()
                while time.monotonic() < t_sample + 3.0 or (
                    full_nodes(peak) < 2 and time.monotonic() < t_sample + 20.0
                ):
                    for n, tokens in live_reservations(new, names, time.time()).items():
                        peak[n] = max(peak[n], tokens)
                    time.sleep(0.02)
            t_end = time.monotonic()
            results = list(load.results)
            failures_after = {e.name: e.state()["lifetime_allocation_failures"] for e in engines}
            time.sleep(RES_TTL_S + 0.5)
            leaked = live_reservations(new, names, time.time())
            new.close()
        codes = Counter(status for _t, status in results)
        served = codes[200] / max(1, len(results))
        during = [s for t, s in results if t_kill <= t <= t_back]
        print(
            f"\nfailover: master :{old_port} killed; sentinel promoted the replica after "
            f"{t_promoted - t_kill:.2f}s; both gateways off degraded mode after {t_back - t_kill:.2f}s; "
            f"{len(results)} requests in {t_end - t_kill + 2.0:.1f}s, served {served:.2%} "
            f"({len(during)} during the window, {sum(1 for s in during if s == 200)} served); "
            f"codes {dict(codes)}; peak reserved after {dict(peak)}; allocation failures at kill "
            f"{failures_at_kill}, when back {failures_at_back}, at the end {failures_after}"
        )
        assert len(during) > 0, "no traffic during the failover window"
        assert served >= 0.99, codes
        assert failures_after == failures_at_back  # no over-commit once the new master serves
        # Reservations were being made on the new master, and they were what kept the nodes
        # full but never over-full (several nodes held three at once).
        assert full_nodes(peak) >= 2, peak
        assert leaked == dict.fromkeys(names, 0)
    finally:
        for e in engines:
            e.stop()
        group.close()
