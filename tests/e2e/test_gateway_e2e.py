"""The gateway's request path end to end: real engines, real gateway, real clients.

Engines are the simulated fragmenting engine (in-process threads); the gateway runs on
uvicorn in a thread; clients are httpx and the official `openai` package.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.workload import make_prompt
from proxy.state.redis_store import RedisStore
from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

LONG = 20_000  # a long document's prompt


def backend(engine: Any, pool: str = "general") -> dict[str, Any]:
    return {"name": engine.name, "url": engine.url, "pool": pool, "kind": "contiguous"}


def wait_reports(url: str, n: int) -> None:
    wait_until(
        lambda: sum(1 for b in fleet_state(url)["backends"] if b["report"]) >= n,
        what="backend reports",
    )


def chat(
    url: str,
    prompt_tokens: int,
    max_tokens: int = 64,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> httpx.Response:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": make_prompt(prompt_tokens)}],
        "max_tokens": max_tokens,
        **extra,
    }
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def engine_failures(engine: Any) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "kvroute_engine_allocation_failures"
        for s in f.samples
        if s.name.endswith("_total")
    )


@pytest.fixture
def two_general(engine_factory: Callable[..., Any]) -> tuple[Any, Any]:
    return engine_factory(name="node-a"), engine_factory(name="node-b")


def test_openai_client_all_endpoints(engine_factory: Callable[..., Any]) -> None:
    long_node = engine_factory(name="long-0")
    general = engine_factory(name="general-0")
    cfg = gateway_cfg([backend(long_node, "long"), backend(general)])
    with run_gateway(cfg) as url:
        wait_reports(url, 2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
        c = raw.parse()
        assert (
            c.choices[0].message.content and c.usage is not None and c.usage.completion_tokens == 8
        )
        assert (
            raw.headers["x-kvroute-backend"] == "general-0"
            and raw.headers["x-kvroute-class"] == "short"
        )
        assert (
            raw.headers["x-kvroute-attempts"] == "1"
            and int(raw.headers["x-kvroute-demand-tokens"]) > 8
        )

        chunks = list(
            client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=12,
                stream=True,
            )
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks and text

        comp = client.completions.create(model="sim-model", prompt="once upon a time", max_tokens=5)
        assert comp.choices[0].text
        stream = list(
            client.completions.create(model="sim-model", prompt="once", max_tokens=6, stream=True)
        )
        assert stream and "".join(s.choices[0].text for s in stream if s.choices)

        # A long document goes to the long pool.
        long_raw = client.chat.completions.with_raw_response.create(
            model="sim-model",
            messages=[{"role": "user", "content": make_prompt(LONG)}],
            max_tokens=16,
        )
        assert (
            long_raw.headers["x-kvroute-class"] == "long"
            and long_raw.headers["x-kvroute-backend"] == "long-0"
        )

        models = client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]


def test_long_request_avoids_fragmented_node_where_round_robin_fails(
    two_general: tuple[Any, Any],
) -> None:
    a, b = two_general
    a.fragment(4_000)  # ~50% free, no gap above 4k tokens
    for policy, expect_failures in (("kvroute", False), ("round_robin", True)):
        cfg = gateway_cfg(
            [backend(a), backend(b)], routing={"policy": policy}, retry={"max_attempts": 1}
        )
        with run_gateway(cfg) as url:
            wait_reports(url, 2)
            rs = [chat(url, LONG) for _ in range(4)]
            failed = [r for r in rs if r.status_code != 200]
            if expect_failures:
                assert failed and all(r.status_code == 503 for r in failed)
                assert failed[0].json()["error"]["type"] == "kv_cache_allocation_error"
            else:
                assert not failed
                assert {r.headers["x-kvroute-backend"] for r in rs} == {"node-b"}


def test_allocation_failure_is_diverted_to_another_node(two_general: tuple[Any, Any]) -> None:
    a, b = two_general
    # The gateway's last report shows node-a (the long pool) fresh; then it fragments before the next scrape.
    cfg = gateway_cfg(
        [backend(a, "long"), backend(b)], collector={"scrape_interval_s": 30, "stale_after_s": 60}
    )
    with run_gateway(cfg) as url:
        wait_reports(url, 2)
        a.fragment(4_000)
        r = chat(url, LONG)
        assert r.status_code == 200
        assert r.headers["x-kvroute-backend"] == "node-b" and r.headers["x-kvroute-attempts"] == "2"
        assert engine_failures(a) == 1
        metrics = httpx.get(url + "/metrics").text
        assert (
            'kvroute_allocation_failures_total{backend="node-a",cause="fragmentation"} 1.0'
            in metrics
        )
        # The node learned it cannot fit this size now: the next long request goes straight to node-b.
        r2 = chat(url, LONG)
        assert (
            r2.headers["x-kvroute-backend"] == "node-b" and r2.headers["x-kvroute-attempts"] == "1"
        )
        assert engine_failures(a) == 1


def test_client_retry_with_same_key_avoids_the_failed_node(two_general: tuple[Any, Any]) -> None:
    a, b = two_general
    cfg = gateway_cfg(
        [backend(a, "long"), backend(b)],
        collector={"scrape_interval_s": 30, "stale_after_s": 60},
        retry={
            "max_attempts": 1,
            "ceiling_ttl_s": 0.001,
        },  # no learned ceiling: only the retry key can help
    )
    with run_gateway(cfg) as url:
        wait_reports(url, 2)
        a.fragment(4_000)
        first = chat(url, LONG, headers={"Idempotency-Key": "doc-42"})
        assert first.status_code == 503 and first.headers["x-kvroute-backend"] == "node-a"
        retry = chat(url, LONG, headers={"Idempotency-Key": "doc-42"})
        assert retry.status_code == 200 and retry.headers["x-kvroute-backend"] == "node-b", (
            dict(retry.headers),
            retry.text,
        )
        # Without the key, the same request lands on the same fragmented node again.
        blind = chat(url, LONG)
        assert blind.status_code == 503 and blind.headers["x-kvroute-backend"] == "node-a"


def test_nothing_fits_answers_503_with_cause_and_retry_after(two_general: tuple[Any, Any]) -> None:
    a, b = two_general
    a.fragment(4_000)
    b.fragment(4_000)
    cfg = gateway_cfg([backend(a), backend(b)], queue={"max_wait_s": 0.3})
    with run_gateway(cfg) as url:
        wait_reports(url, 2)
        wait_until(
            lambda: all(
                (x["report"] or {}).get("largest_free_block_tokens", 1e9) <= 4_000
                for x in fleet_state(url)["backends"]
            )
        )
        r = chat(url, LONG)
        assert r.status_code == 503 and r.headers["retry-after"]
        err = r.json()["error"]
        assert err["cause"] == "fragmentation" and "contiguous free block" in err["message"]
        assert (
            engine_failures(a) + engine_failures(b) == 0
        )  # refused at the gateway: no wasted attempt


def test_disconnecting_stream_releases_reservation(engine_factory: Callable[..., Any]) -> None:
    slow = engine_factory(name="slow", speedup=1.0, decode_tokens_per_s=50.0)
    cfg = gateway_cfg([backend(slow)])
    with run_gateway(cfg) as url:
        wait_reports(url, 1)
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": 2_000,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            chunks = (
                resp.iter_raw()
            )  # keep the iterator: dropping it would close the stream already
            next(chunks)
            node = fleet_state(url)["backends"][0]
            assert node["overlay"]["inflight"] == 1 and node["overlay"]["reserved_tokens"] > 2_000
        # Client gone: the reservation is released and the engine frees the memory.
        wait_until(
            lambda: fleet_state(url)["backends"][0]["overlay"]["inflight"] == 0,
            what="reservation released",
        )
        wait_until(
            lambda: slow.state()["free_tokens"] == slow.state()["capacity_tokens"],
            what="engine freed memory",
        )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{", 400, None),
        (b'{"model": "m"}', 400, "messages"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999}',
            400,
            "max_tokens",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
    ],
)
def test_bad_input_is_4xx_and_changes_nothing(
    engine_factory: Callable[..., Any], body: bytes, status: int, param: str | None
) -> None:
    e = engine_factory(name="e1")
    with run_gateway(gateway_cfg([backend(e)], routing={"max_tokens_limit": 100_000})) as url:
        wait_reports(url, 1)
        r = httpx.post(
            url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == status
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and "type" in err and "code" in err
        assert fleet_state(url)["backends"][0]["overlay"]["inflight"] == 0
        assert e.state()["free_tokens"] == e.state()["capacity_tokens"]


def test_oversized_body_and_impossible_demand(engine_factory: Callable[..., Any]) -> None:
    e = engine_factory(name="e1", capacity_tokens=50_000)
    with run_gateway(gateway_cfg([backend(e)], limits={"max_body_bytes": 10_000})) as url:
        wait_reports(url, 1)
        big = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x" * 20_000})
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    with run_gateway(gateway_cfg([backend(e)])) as url:
        wait_reports(url, 1)
        r = chat(url, 100, max_tokens=60_000)  # demand above every backend's capacity
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # The engine lists max_model_len 50000: the limit it enforces, in vLLM's words.
        assert "maximum context length is 50000 tokens" in r.json()["error"]["message"]


def test_two_gateways_sharing_redis_never_overcommit(
    engine_factory: Callable[..., Any], redis_server: str
) -> None:
    # One engine, 100k tokens; requests live ~1 s. Reports refresh rarely, so only the shared
    # reservations in Redis stop the two gateways from both filling the same free block.
    e = engine_factory(name="shared", speedup=5.0, decode_tokens_per_s=50.0)  # requests live ~4 s
    import asyncio

    asyncio.run(_flush(redis_server))
    cfg = gateway_cfg(
        [backend(e)],
        # A long grace: every reservation counts until a report surely includes it, so only the
        # atomic reserve in Redis (not report timing) decides what fits.
        # A generous deadline too: on a loaded machine a timed-out reserve routes without a
        # reservation (degraded mode, by design), which is not what this test is about.
        store={"redis_url": redis_server, "report_grace_s": 10.0, "op_timeout_s": 2.0},
        collector={"scrape_interval_s": 30, "stale_after_s": 60},
        queue={"max_wait_s": 0.0},
        retry={"max_attempts": 1},
    )
    with run_gateway(cfg) as g1, run_gateway(cfg) as g2:
        wait_reports(g1, 1)
        wait_reports(g2, 1)
        start = threading.Barrier(16)

        def fire(i: int) -> int:
            start.wait()
            return chat(g1 if i % 2 else g2, 18_000, max_tokens=1_000).status_code

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(fire, range(16)))
    assert codes.count(200) >= 4  # 5 x 19k fit in 100k; at least 4 get in with the margin
    assert engine_failures(e) == 0  # never over-committed: the engine refused nothing
    assert set(codes) <= {200, 503}


async def _flush(url: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    await r.flushdb()
    await r.aclose()


def test_redis_store_used_by_gateway_leaves_no_reservations(
    engine_factory: Callable[..., Any], redis_server: str
) -> None:
    """Checked while the gateway still runs (its shutdown releases everything it holds, which
    would hide a leak), with reservations that live 900 s (the default TTL)."""
    import asyncio
    import time

    from proxy.config import StoreConfig

    asyncio.run(_flush(redis_server))
    e = engine_factory(name="r1")

    async def left() -> int:
        store = RedisStore(StoreConfig(redis_url=redis_server))
        try:
            return len(await store.reservations("r1", time.time()))
        finally:
            await store.close()

    seen: list[Any] = []

    def released(url: str) -> bool:
        seen[:] = [fleet_state(url)["reservations"], asyncio.run(left())]
        return seen == [{"held": 0, "pending_releases": 0}, 0]

    with run_gateway(gateway_cfg([backend(e)], store={"redis_url": redis_server})) as url:
        wait_reports(url, 1)
        assert all(chat(url, 50).status_code == 200 for _ in range(3))
        assert all(chat(url, 50, stream=True).status_code == 200 for _ in range(2))
        assert chat(url, 50, max_tokens=-1).status_code == 400
        try:
            wait_until(lambda: released(url), what="every reservation released")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen (ledger, in Redis): {seen}") from None
