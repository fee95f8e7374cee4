"""Black box, real processes: a gateway replica SIGKILLed with a document in flight takes its
reservation with it, within the lease TTL, as the surviving replica sees it (issue 51).

One real ``redis-server``, two simulated engines (contiguous, or vLLM-like: ``--behaviour
vllm``, lazily allocating, where every reservation counts at full demand), two ``kvroute
serve`` processes on the shared Redis with the shipped defaults (``store.lease_ttl_s`` 5 s,
``store.reservation_ttl_s`` 900 s). A ~21k-token request goes through replica A; once the
survivor B's ``/fleet`` shows A's reservation, A is SIGKILLed, and B's ``/fleet`` must show
no reserved token on any backend within the lease TTL (plus its scrape and read cadence).

Before leases (the commit before them), B's ``/fleet`` kept showing the reservation for the
reservation TTL (900 s): this test fails there at the first wait after the kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.local_fleet import EngineSpec, Proc, engine_proc, free_port, gateway_config, wait_http
from loadtest.workload import make_prompt
from tests.support.redis_server import RedisInstance

LEASE_TTL_S = 5.0  # store.lease_ttl_s's default: the test runs the shipped configuration
# What B adds on top of the TTL before its /fleet shows the lapse: none (the read script skips
# a lapsed lease at once); the poll below runs every 0.1 s.
SLACK_S = 1.0
PROMPT_TOKENS = 20_000
MAX_TOKENS = 1_500  # ~30 s of decode at 50 tokens/s: still in flight when A dies


def engine_specs(kind: str) -> list[EngineSpec]:
    extra: tuple[str, ...] = ("--decode-tokens-per-s", "50")
    if kind == "vllm":
        extra += ("--behaviour", "vllm", "--max-model-len", "32768")
    return [
        EngineSpec(name=f"e{i}", capacity_tokens=60_000, speedup=1.0, extra=extra) for i in range(2)
    ]


def serve(name: str, config: Path, workdir: Path) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    argv += ["--port", str(port), "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    g = Proc(name, argv, f"http://127.0.0.1:{port}")
    g.start(env=env, log_dir=workdir)
    wait_http(g.url + "/health", timeout_s=40, proc=g.popen)
    return g


@contextlib.contextmanager
def two_replicas(kind: str, workdir: Path) -> Iterator[tuple[Proc, Proc, str]]:
    procs: list[Proc] = []
    redis = RedisInstance(workdir / "redis")
    (workdir / "redis").mkdir()
    try:
        redis.start()
        specs = engine_specs(kind)
        for spec in specs:
            p = engine_proc(spec)
            p.start(log_dir=workdir)
            procs.append(p)
        for p in procs:
            wait_http(p.url + "/health", timeout_s=30, proc=p.popen)
        cfg = gateway_config(list(zip(specs, [p.url for p in procs], strict=True)))
        for b in cfg["backends"]:
            b["kind"] = kind
        cfg["store"] = {"redis_url": redis.url, "leases": True}
        (workdir / "kvroute.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        a = serve("gateway-a", workdir / "kvroute.yaml", workdir)
        procs.append(a)
        b = serve("gateway-b", workdir / "kvroute.yaml", workdir)
        procs.append(b)
        yield a, b, redis.url
    finally:
        for p in reversed(procs):
            p.stop()
        redis.close()


def fleet(url: str) -> dict[str, Any]:
    got: dict[str, Any] = httpx.get(url + "/fleet", timeout=5).json()
    return got


def reserved_tokens(url: str) -> int:
    """Every backend's reserved tokens as this replica's ``/fleet`` shows them (the store's)."""
    return sum(int(b["overlay"]["reserved_tokens"]) for b in fleet(url)["backends"])


def lease_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        if "lease" in fam.name
        for s in fam.samples
        if s.name.endswith("_total")
    }


def live_reservations_in_redis(url: str) -> dict[str, int]:
    """Fields left in every backend's ``:res`` hash (counting or not)."""
    r = redis.Redis.from_url(url, socket_timeout=2)
    try:
        return {k.decode(): r.hlen(k) for k in r.scan_iter(match="kvroute:backend:*:res")}
    finally:
        r.close()


def wait(predicate: Any, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held, polled every 0.1 s; fails with what was last seen."""
    start = time.monotonic()
    seen: object = None
    while time.monotonic() - start < timeout_s:
        ok, seen = predicate()
        if ok:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s; last seen {seen!r}")


def send_document(url: str) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": make_prompt(PROMPT_TOKENS)}],
        "max_tokens": MAX_TOKENS,
    }
    with contextlib.suppress(httpx.HTTPError):  # A dies under it: the client sees a reset
        httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


@pytest.mark.parametrize("kind", ["contiguous", "vllm"])
def test_a_killed_replicas_reservation_stops_counting_within_the_lease_ttl(
    kind: str, tmp_path: Path
) -> None:
    with two_replicas(kind, tmp_path) as (a, b, redis_url):
        for g in (a, b):
            wait(
                lambda g=g: (
                    all(n["report"] for n in fleet(g.url)["backends"]),
                    fleet(g.url)["backends"],
                ),
                30,
                f"{g.name} to see both engines report",
            )
        threading.Thread(target=send_document, args=(a.url,), daemon=True).start()
        demand = PROMPT_TOKENS + MAX_TOKENS
        # The document is in flight through A, and B counts A's reservation.
        wait(lambda: (reserved_tokens(b.url) >= demand, reserved_tokens(b.url)), 30, "B sees it")
        assert fleet(a.url)["reservations"]["held"] == 1
        a.signal(signal.SIGKILL)
        assert a.popen is not None
        a.popen.wait(10)
        killed_at = time.monotonic()
        assert len(live_reservations_in_redis(redis_url)) == 1
        still = reserved_tokens(b.url)
        assert still >= demand, f"A's reservation must still count right after the kill: {still}"
        took = wait(
            lambda: (reserved_tokens(b.url) == 0, reserved_tokens(b.url)),
            LEASE_TTL_S + SLACK_S,
            "A's reserved tokens gone from B's /fleet",
        )
        print(f"\n[{kind}] A's {still} reserved tokens stopped counting {took:.2f} s after SIGKILL")
        # B's /fleet says why: A's lease is no longer live, only B's, and nothing counts in
        # A's name any more.
        replicas = fleet(b.url)["replicas"]
        assert list(replicas["live"]) == [replicas["this"]], replicas
        assert replicas["reserved_tokens"] == {}, replicas
        # B's next renewal (every TTL/3) found the lapse and swept A's reservation out of Redis.
        # (More than one lapse only if A, starved on a busy machine, had re-registered.)
        wait(
            lambda: (
                lease_metrics(b.url).get("kvroute_lease_reserved_tokens_dropped_total") == still,
                lease_metrics(b.url),
            ),
            LEASE_TTL_S / 3 + SLACK_S,
            "B's sweep of A's lease",
        )
        assert lease_metrics(b.url)["kvroute_leases_lapsed_total"] >= 1
        assert live_reservations_in_redis(redis_url) == {}, "the sweep leaves nothing behind"
        print(f"[{kind}] swept from Redis {time.monotonic() - killed_at:.2f} s after SIGKILL")
