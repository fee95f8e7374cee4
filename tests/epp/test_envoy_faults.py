"""The endpoint picker behind a real Envoy when things go wrong: shedding, a client that
leaves mid-stream, the EPP killed (each of Envoy's failure modes), and the fragmentation
workload that must waste no attempt on a node that cannot allocate it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from loadtest.workload import make_prompt
from proxy.epp.endpoints import address_of
from proxy.epp.health import EXT_PROC_SERVICE
from tests.epp.test_envoy_e2e import MODEL, config_of, inflight, picked, tapped
from tests.support.envoy import Envoy, run_envoy
from tests.support.epp import Tap, epp_process, run_epp
from tests.support.gateway import fleet_state, gateway_cfg, wait_until

pytestmark = pytest.mark.usefixtures("envoy_installed")

SLOW = {"speedup": 1.0, "decode_tokens_per_s": 50.0}
STORY = {"model": MODEL, "messages": [{"role": "user", "content": "a story"}], "max_tokens": 2_000}


def engine_failures(engine: Any) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvroute_engine_allocation_failures"
        for s in f.samples
        if s.name.endswith("_total")
    )


def test_429_when_shedding(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    a = tapped(engine_factory, taps, "a", **SLOW)
    limits = {"max_concurrent_requests": 1}
    with picked(config_of(a), limits=limits) as (epp, envoy):
        url = envoy.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**STORY, "stream": True}, timeout=30) as held:
            assert held.status_code == 200
            chunks = held.iter_raw()
            next(chunks)
            r = httpx.post(url, json={**STORY, "max_tokens": 4}, timeout=20)
            assert r.status_code == 429 and r.headers["retry-after"]
            assert r.json()["error"]["code"] == "too_many_concurrent_requests"
        # The slot is given back with the stream: the next request passes.
        wait_until(lambda: inflight(epp) == 0, what="reservation released")
        r = httpx.post(url, json={**STORY, "max_tokens": 4}, timeout=20)
        assert r.status_code == 200


def test_client_leaving_mid_stream_releases_once(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    a = tapped(engine_factory, taps, "a", **SLOW)
    eng = a["_engine"]
    with picked(config_of(a)) as (epp, envoy):
        url = envoy.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**STORY, "stream": True}, timeout=30) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_raw()
            next(chunks)
            node = fleet_state(epp.url)["backends"][0]
            assert node["overlay"]["inflight"] == 1 and node["overlay"]["reserved_tokens"] > 2_000
        wait_until(lambda: inflight(epp) == 0, what="reservation released")
        wait_until(
            lambda: eng.state()["free_tokens"] == eng.state()["capacity_tokens"],
            what="engine freed memory",
        )
        metrics = httpx.get(epp.url + "/metrics").text
        assert (
            'kvroute_requests_total{backend="a",class="short",outcome="client_disconnect"} 1.0'
            in metrics
        )
        assert 'outcome="success"' not in metrics


def _config(*backends: dict[str, Any]) -> dict[str, Any]:
    return {
        "pools": {"general": {"role": "general"}},
        "backends": config_of(*backends),
        "collector": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
        "routing": {"unknown_model": "pass_through"},
    }


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail_close", "fail_open"])
def test_epp_killed(
    engine_factory: Callable[..., Any], taps: list[Tap], tmp_path: Path, fail_open: bool
) -> None:
    a = tapped(engine_factory, taps, "a")
    fallback = tapped(engine_factory, taps, "fallback")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with (
        epp_process(_config(a), tmp_path) as epp,
        run_envoy(epp.port, fail_open=fail_open, fallback=address_of(fallback["url"])) as envoy,
    ):
        wait_until(lambda: fleet_state(epp.url)["backends"][0]["report"] is not None)
        url = envoy.url + "/v1/chat/completions"
        r = httpx.post(url, json=body, timeout=20)
        assert r.status_code == 200 and r.headers["x-kvroute-backend"] == "a"
        epp.kill()
        wait_until(lambda: envoy.stat("cluster.epp.upstream_cx_active") == 0, what="EPP gone")
        refused = envoy.stat("cluster.epp.upstream_cx_connect_fail")
        r = httpx.post(url, content=_after_refusal(envoy, refused, body), timeout=20)
        if fail_open:
            # Failing open, the request passes without a pick: the route's fallback serves it.
            assert r.status_code == 200 and "x-kvroute-backend" not in r.headers
            assert len(fallback["_tap"].exchanges) == 1
        else:
            # Failing closed, Envoy answers itself and nothing reaches an upstream.
            assert r.status_code == 500, (r.status_code, r.text)
            assert not fallback["_tap"].exchanges
        assert len(a["_tap"].exchanges) == 1


def _after_refusal(envoy: Envoy, before: int, body: dict[str, Any]) -> Iterator[bytes]:
    """The body, sent once Envoy's connection to the EPP was refused.

    Envoy can fail open only before the first body chunk reaches the EPP (envoy #41276): a
    body sent with the headers is in flight to a dead EPP, and such a request fails closed
    whatever ``failure_mode_allow`` says. Its headers alone go first here (``before``: Envoy's
    count of refused connections to the EPP, read before the request).
    """
    wait_until(
        lambda: envoy.stat("cluster.epp.upstream_cx_connect_fail") > before,
        what="Envoy refused by the dead EPP",
    )
    yield json.dumps(body).encode()


def _workload(url: str) -> list[int]:
    """Long documents and short chats at once, more long ones than the whole node holds."""

    def one(i: int) -> int:
        long = i % 3 == 0
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(20_000 if long else 200)}],
            "max_tokens": 32,
        }
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(24)))


def test_fragmentation_workload_wastes_no_attempt(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    a = tapped(engine_factory, taps, "a", capacity_tokens=100_000)
    b = tapped(engine_factory, taps, "b", capacity_tokens=100_000)
    a["_engine"].fragment(4_000)
    with picked(config_of(a, b), queue={"max_wait_s": 10}) as (epp, envoy):
        wait_until(
            lambda: (
                (fleet_state(epp.url)["backends"][0]["report"] or {}).get(
                    "largest_free_block_tokens", 1e9
                )
                <= 4_000
            ),
            what="the fragmented node's report",
        )
        # The same workload through Envoy and the EPP, then through the gateway itself.
        for door in (envoy.url, epp.url):
            assert _workload(door) == [200] * 24
        assert engine_failures(a["_engine"]) + engine_failures(b["_engine"]) == 0
        long_on_a = [x for x in a["_tap"].exchanges if len(x.request) > 50_000]
        assert not long_on_a
        wait_until(lambda: inflight(epp) == 0, what="every reservation released")


def test_grpc_health(engine_factory: Callable[..., Any], taps: list[Tap]) -> None:
    a = tapped(engine_factory, taps, "a")
    with picked(config_of(a)) as (epp, _envoy):
        with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("liveness", "readiness", EXT_PROC_SERVICE, ""):
                answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def test_a_client_leaving_while_held_leaves_nothing_behind(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    a = tapped(engine_factory, taps, "a")
    a["_engine"].fragment(4_000)
    with picked(config_of(a), queue={"max_wait_s": 30}) as (epp, envoy):
        wait_until(
            lambda: (
                (fleet_state(epp.url)["backends"][0]["report"] or {}).get(
                    "largest_free_block_tokens", 1e9
                )
                <= 4_000
            ),
            what="the fragmented report",
        )
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(20_000)}],
            "max_tokens": 32,
        }
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=1.0)
        # The hold ended with the stream: no place in line, no reservation, nothing sent.
        wait_until(lambda: _gauge(epp.url, "kvroute_queue_depth") == 0, what="the hold ended")
        assert inflight(epp) == 0 and not a["_tap"].exchanges


def test_an_upstream_dying_mid_stream_releases(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    eng = engine_factory(name="a", mode="process", **SLOW)
    tap = Tap(eng.url).start()
    taps.append(tap)
    with picked([{"name": "a", "url": tap.url, "kind": "contiguous"}]) as (epp, envoy):
        url = envoy.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json={**STORY, "stream": True}, timeout=30) as resp:
            chunks = resp.iter_raw()
            next(chunks)
            assert inflight(epp) == 1
            eng.kill()
            with pytest.raises(httpx.HTTPError):
                for _ in chunks:
                    pass
        wait_until(lambda: inflight(epp) == 0, what="reservation released")


def test_two_epp_replicas_on_one_redis_never_overcommit(
    engine_factory: Callable[..., Any], redis_server: str
) -> None:
    """Active-active: Envoy spreads streams over two EPPs; the reservations they share in
    Redis, not report timing, keep them from both filling the same free block."""
    eng = engine_factory(name="shared", speedup=5.0, decode_tokens_per_s=50.0)
    asyncio.run(_flush(redis_server))
    cfg = gateway_cfg(
        [{"name": "shared", "url": eng.url, "kind": "contiguous"}],
        store={"redis_url": redis_server, "report_grace_s": 10.0, "op_timeout_s": 2.0},
        collector={"scrape_interval_s": 30, "stale_after_s": 60},
        queue={"max_wait_s": 0.0},
    )
    with run_epp(cfg) as one, run_epp(cfg) as two, run_envoy([one.port, two.port]) as envoy:
        for epp in (one, two):
            wait_until(lambda e=epp: fleet_state(e.url)["backends"][0]["report"] is not None)
        start = threading.Barrier(16)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(18_000)}],
            "max_tokens": 1_000,
        }

        def fire(_: int) -> int:
            start.wait()
            url = envoy.url + "/v1/chat/completions"
            return httpx.post(url, json=body, timeout=60).status_code

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(fire, range(16)))
        served = [_gauge(e.url, "kvroute_requests_total") for e in (one, two)]
    # Never over-committed: the engine refused nothing, whichever replica placed what. (How
    # many of the 16 get in varies: 5 fit, and replicas sharing Redis admit fewer under a
    # burst, through the EPP as through the HTTP gateway.)
    assert codes.count(200) >= 1 and set(codes) <= {200, 503}, codes
    assert engine_failures(eng) == 0
    # Both replicas picked: Envoy spread the streams over them.
    assert all(n > 0 for n in served), served


async def _flush(url: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    await r.flushdb()
    await r.aclose()


def test_an_allocation_failure_teaches_the_next_pick(
    engine_factory: Callable[..., Any], taps: list[Tap]
) -> None:
    """Envoy forwards, so the failed request is the client's to retry; but the EPP reads the
    answer as the gateway does, and the next long request goes where it fits."""
    a = tapped(engine_factory, taps, "a")
    b = tapped(engine_factory, taps, "b")
    backends = config_of(a, b)
    backends[0]["pool"] = "long"
    quiet = {"scrape_interval_s": 30, "stale_after_s": 60}
    with picked(backends, collector=quiet) as (epp, envoy):
        a["_engine"].fragment(4_000)  # after its last report: the EPP does not know yet
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": make_prompt(20_000)}],
            "max_tokens": 64,
        }
        url = envoy.url + "/v1/chat/completions"
        first = httpx.post(url, json=body, timeout=30)
        assert first.status_code >= 500 and first.headers["x-kvroute-backend"] == "a"
        assert engine_failures(a["_engine"]) == 1
        metrics = httpx.get(epp.url + "/metrics").text
        assert 'kvroute_allocation_failures_total{backend="a",cause="fragmentation"} 1.0' in metrics
        wait_until(lambda: inflight(epp) == 0, what="released once, by the booking")
        second = httpx.post(url, json=body, timeout=30)
        assert second.status_code == 200 and second.headers["x-kvroute-backend"] == "b"
        assert engine_failures(a["_engine"]) == 1
