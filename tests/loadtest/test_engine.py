"""The simulated engine over real HTTP: httpx and the official openai client against it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.engine.server import EngineConfig, main
from loadtest.workload import make_prompt
from proxy.core import backend_contract as contract
from proxy.core.tokens import count_text
from tests.support.engines import ThreadEngine, wait_until

pytestmark = pytest.mark.timeout(60)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with these labels) in a Prometheus text exposition."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


def sse_events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]


async def state_until(
    c: httpx.AsyncClient, pred: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Poll /admin/state (on ``c``'s base URL) until ``pred`` holds; returns that state."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        st: dict[str, Any] = (await c.get("/admin/state")).json()
        if pred(st):
            return st
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {st}")
        await asyncio.sleep(0.005)


def prompt_of(tokens: int, seed: int = 0) -> str:
    text = make_prompt(tokens, random.Random(seed))
    assert count_text(text) == tokens
    return text


async def test_completion_non_stream(engine_factory: Any) -> None:
    eng = engine_factory(name="e1")
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        r = await c.post(
            "/v1/completions", json={"model": "m", "prompt": "hello there world", "max_tokens": 37}
        )
    assert r.status_code == 200, r.text
    assert r.headers["x-engine-name"] == "e1"
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert count_text(body["choices"][0]["text"]) == 37
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 37, "total_tokens": 40}
    # Everything is given back once the request is done.
    assert eng.state()["free_tokens"] == 100_000


async def test_chat_with_openai_client(engine_factory: Any) -> None:
    eng = engine_factory()
    client = openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is a cache?"},
    ]
    resp = await client.chat.completions.create(model="sim-model", messages=messages, max_tokens=20)  # type: ignore[arg-type]
    assert resp.choices[0].message.role == "assistant"
    assert count_text(resp.choices[0].message.content or "") == 20
    assert resp.usage is not None and resp.usage.completion_tokens == 20
    # OpenAI's chat counting: 3 per message + role + content, 3 for the reply.
    expected_prompt = 3 + sum(
        3 + count_text(m["role"]) + count_text(m["content"]) for m in messages
    )
    assert resp.usage.prompt_tokens == expected_prompt

    # max_completion_tokens is honoured too, and the default applies when both are absent.
    resp2 = await client.chat.completions.create(
        model="x", messages=messages, max_completion_tokens=5
    )  # type: ignore[arg-type]
    assert resp2.usage is not None and resp2.usage.completion_tokens == 5
    resp3 = await client.chat.completions.create(model="x", messages=messages)  # type: ignore[arg-type]
    assert resp3.usage is not None and resp3.usage.completion_tokens == 256

    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-model"]
    await client.close()


async def test_streaming_completion_httpx(engine_factory: Any) -> None:
    eng = engine_factory(chunk_interval_s=0.0)  # one token per chunk
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        r = await c.post(
            "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 12, "stream": True}
        )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 12
    text = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert count_text(text) == 12
    assert [ch["choices"][0]["finish_reason"] for ch in chunks][-2:] == [None, "length"]
    assert all("usage" not in ch for ch in chunks)


async def test_streaming_chat_openai_with_usage(engine_factory: Any) -> None:
    eng = engine_factory(allocator="paged")
    client = openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=300,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    usage = None
    finish = None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert count_text("".join(parts)) == 300
    assert finish == "length"
    assert (
        usage is not None
        and usage.completion_tokens == 300
        and usage.prompt_tokens == 3 + 3 + 1 + count_text("stream please")
    )
    await client.close()


async def test_large_prompt_is_counted_exactly(engine_factory: Any) -> None:
    eng = engine_factory(capacity_tokens=200_000)
    prompt = prompt_of(30_000, seed=3)
    async with httpx.AsyncClient(base_url=eng.url, timeout=20) as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1})
        ids = await c.post(
            "/v1/completions", json={"model": "m", "prompt": list(range(77)), "max_tokens": 1}
        )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 30_000
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 77


async def test_metrics_follow_allocation_and_free(engine_factory: Any) -> None:
    # Real-time pace for this one: 50 tokens at 50 tok/s keeps the request alive about a second.
    eng = engine_factory(speedup=1.0, decode_tokens_per_s=50.0, capacity_tokens=50_000)
    async with httpx.AsyncClient(base_url=eng.url, timeout=20) as c:
        m0 = (await c.get("/metrics")).text
        assert metric(m0, contract.CAPACITY) == 50_000
        assert metric(m0, contract.FREE) == 50_000
        assert metric(m0, contract.LARGEST_FREE_BLOCK) == 50_000
        assert metric(m0, contract.ALLOCATOR_INFO, allocator="contiguous", block_size="1") == 1
        assert metric(m0, contract.START_TIME) > 1e9
        assert metric(m0, contract.RUNNING) == 0
        assert metric(m0, contract.ALLOCATION_FAILURES) == 0
        with pytest.raises(KeyError):
            metric(m0, contract.VLLM_KV_USAGE)  # vLLM's names only on a paged engine

        prompt = prompt_of(950)
        task = asyncio.create_task(
            c.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 50})
        )
        await state_until(c, lambda st: st["running"] == 1, "the request to be placed")
        m1 = (await c.get("/metrics")).text
        assert metric(m1, contract.RUNNING) == 1
        assert metric(m1, contract.FREE) == 50_000 - 1_000
        assert metric(m1, contract.LARGEST_FREE_BLOCK) == 49_000
        r = await task
        assert r.status_code == 200
        m2 = (await c.get("/metrics")).text
        assert metric(m2, contract.FREE) == 50_000 and metric(m2, contract.RUNNING) == 0
        assert metric(m2, "kvroute_engine_requests_total", outcome="ok") == 1


async def test_paged_engine_exports_vllm_names(engine_factory: Any) -> None:
    eng = engine_factory(allocator="paged", block_size=16, capacity_tokens=16_000)
    eng.hold(100)  # 7 blocks
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        text = (await c.get("/metrics")).text
    assert metric(text, contract.VLLM_CACHE_CONFIG, block_size="16", num_gpu_blocks="1000") == 1
    assert metric(text, contract.VLLM_KV_USAGE) == pytest.approx(7 / 1000)
    assert metric(text, contract.VLLM_RUNNING) == 0 and metric(text, contract.VLLM_WAITING) == 0
    assert metric(text, contract.ALLOCATOR_INFO, allocator="paged", block_size="16") == 1
    assert metric(text, contract.FREE) == 16_000 - 7 * 16
    assert metric(text, contract.LARGEST_FREE_BLOCK) == 16_000 - 7 * 16
    assert metric(text, contract.VLLM_START_TIME) > 1e9


async def _hold_with_requests(
    c: httpx.AsyncClient, sizes: list[int]
) -> list[asyncio.Task[httpx.Response]]:
    """Start long-lived non-streaming requests of these total sizes, in order (first-fit = address order)."""
    tasks = []
    for i, size in enumerate(sizes):
        body = {"model": "m", "prompt": prompt_of(size - 1_000, seed=i), "max_tokens": 1_000}
        tasks.append(asyncio.create_task(c.post("/v1/completions", json=body)))
        # wait for it to be placed before sending the next, so addresses follow the order
        want = i + 1
        await state_until(c, lambda st, want=want: st["running"] == want, f"request {i} placed")
    return tasks


async def test_allocation_failure_contract_on_fragmented_engine(engine_factory: Any) -> None:
    # 1,000 output tokens at 50 tok/s: 20 s of life, far beyond the test; cancelled at the end.
    eng = engine_factory(speedup=1.0, capacity_tokens=100_000)
    async with httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
        tasks = await _hold_with_requests(c, [30_000, 30_000, 30_000, 10_000])
        st = (await c.get("/admin/state")).json()
        assert st["free_tokens"] == 0 and st["running"] == 4

        # Completely full: a genuine capacity failure.
        small = {"model": "m", "prompt": "hi", "max_tokens": 10}
        r = await c.post("/v1/completions", json=small)
        assert r.status_code == contract.ALLOCATION_ERROR_STATUS
        err = r.json()["error"]
        assert (
            err["type"] == contract.ALLOCATION_ERROR_TYPE
            and err["code"] == contract.ALLOCATION_ERROR_CODE
        )
        assert (err["demand_tokens"], err["free_tokens"], err["largest_free_block_tokens"]) == (
            11,
            0,
            0,
        )

        # Free the 1st and 3rd: 60k free, but in two 30k gaps.
        for t in (tasks[0], tasks[2]):
            t.cancel()
        await asyncio.gather(tasks[0], tasks[2], return_exceptions=True)
        st = await state_until(c, lambda st: st["free_tokens"] == 60_000, "two requests freed")
        assert (
            st["free_tokens"] == 60_000
            and st["largest_free_block_tokens"] == 30_000
            and st["gaps"] == 2
        )

        big = {"model": "m", "prompt": prompt_of(34_000), "max_tokens": 1_000}
        r = await c.post("/v1/completions", json=big)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "kv_cache_allocation_error"
        assert err["param"] is None and "35000" in err["message"]
        assert (err["demand_tokens"], err["free_tokens"], err["largest_free_block_tokens"]) == (
            35_000,
            60_000,
            30_000,
        )

        # The official client surfaces it as a 503 with the body intact.
        client = openai.AsyncOpenAI(base_url=eng.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc_info:
            await client.completions.create(model="m", prompt=big["prompt"], max_tokens=1_000)
        assert exc_info.value.status_code == 503
        assert (
            isinstance(exc_info.value.body, dict) and exc_info.value.body["demand_tokens"] == 35_000
        )
        await client.close()

        m = (await c.get("/metrics")).text
        assert metric(m, contract.ALLOCATION_FAILURES) == 3
        assert metric(m, "kvroute_engine_requests_total", outcome="allocation_failed") == 3
        assert metric(m, contract.LARGEST_FREE_BLOCK) == 30_000
        # A request that fits a gap is placed in it.
        ok = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200  # 2 tokens fit in a 30k gap
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wait_until(lambda: eng.state()["free_tokens"] == 100_000, what="all memory freed")


async def test_paged_engine_places_what_contiguous_cannot(engine_factory: Any) -> None:
    eng = engine_factory(allocator="paged", capacity_tokens=96_000, block_size=16)
    state = eng.fragment(hole_tokens=1_200)  # every other 1,200-token region free
    assert state["free_tokens"] >= 40_000
    async with httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
        r = await c.post(
            "/v1/completions", json={"model": "m", "prompt": prompt_of(20_000), "max_tokens": 16}
        )
    assert r.status_code == 200, r.text

    contiguous = engine_factory(capacity_tokens=96_000)
    state = contiguous.fragment(hole_tokens=1_200)
    assert state["free_tokens"] == 48_000 and state["largest_free_block_tokens"] == 1_200
    async with httpx.AsyncClient(base_url=contiguous.url, timeout=30) as c:
        r = await c.post(
            "/v1/completions", json={"model": "m", "prompt": prompt_of(20_000), "max_tokens": 16}
        )
    assert r.status_code == 503
    assert r.json()["error"]["largest_free_block_tokens"] == 1_200


async def test_context_length_exceeded(engine_factory: Any) -> None:
    eng = engine_factory(capacity_tokens=1_000)
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        r = await c.post(
            "/v1/completions", json={"model": "m", "prompt": prompt_of(900), "max_tokens": 101}
        )
        r_ok = await c.post(
            "/v1/completions", json={"model": "m", "prompt": prompt_of(900), "max_tokens": 100}
        )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded"
    assert "1001" in err["message"]
    assert r_ok.status_code == 200
    assert eng.state()["allocation_failures"] == 0  # not an allocation failure


BAD_REQUESTS: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": 3, "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "m"}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": 12}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": ["a", 1]}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "m"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "m", "messages": ["hi"]}, "messages.[0]"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"content": "hi"}]}, "messages.[0].role"),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": 5}]},
        "messages.[0].content",
    ),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user"}], "max_completion_tokens": -3},
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user"}], "stream_options": 1},
        "stream_options",
    ),
]


async def test_bad_requests_get_openai_errors(engine_factory: Any) -> None:
    eng = engine_factory()
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        for path, body, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = await c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error" and err["message"]
            assert err["param"] == param, (body, err)
        st = (await c.get("/admin/state")).json()
    assert st["free_tokens"] == 100_000 and st["outcomes"]["bad_request"] == len(BAD_REQUESTS)


async def test_strict_model_and_unknown_route(engine_factory: Any) -> None:
    eng = engine_factory(strict_model=True, model="llama")
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        r = await c.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        ok = await c.post(
            "/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 2}
        )
        missing = await c.get("/v1/nothing")
        health = await c.get("/health")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert ok.status_code == 200
    assert missing.status_code == 404
    assert health.status_code == 200


async def test_client_disconnect_mid_stream_frees_memory(engine_factory: Any) -> None:
    eng = engine_factory(speedup=1.0, decode_tokens_per_s=100.0)  # 2,000 tokens: 20 s if left alone
    body = {"model": "m", "prompt": prompt_of(3_000), "max_tokens": 2_000, "stream": True}
    async with httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()  # keep a reference: a dropped iterator closes the connection
            async for line in lines:
                if line.startswith("data: "):
                    break  # first token arrived: the request is decoding
            st = (await c.get("/admin/state")).json()
            assert st["running"] == 1 and st["free_tokens"] == 100_000 - 5_000
        # leaving the block closes the connection mid-stream
    wait_until(lambda: eng.state()["free_tokens"] == 100_000, what="memory freed after disconnect")
    st = eng.state()
    assert st["running"] == 0 and st["outcomes"]["cancelled"] == 1


async def test_client_disconnect_non_stream_frees_memory(engine_factory: Any) -> None:
    eng = engine_factory(speedup=1.0, decode_tokens_per_s=100.0)
    async with httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
        task = asyncio.create_task(
            c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2_000})
        )
        st = await state_until(c, lambda st: st["running"] == 1, "the request to be placed")
        assert st["free_tokens"] == 100_000 - 2_001
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    wait_until(lambda: eng.state()["free_tokens"] == 100_000, what="memory freed after disconnect")


async def test_admin_restart_resets_and_fails_in_flight(engine_factory: Any) -> None:
    eng = engine_factory(speedup=1.0, decode_tokens_per_s=100.0)
    st0 = eng.fragment(hole_tokens=5_000)
    assert st0["largest_free_block_tokens"] == 5_000 and st0["free_tokens"] == 50_000
    async with httpx.AsyncClient(base_url=eng.url, timeout=30) as c:
        in_flight = asyncio.create_task(
            c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2_000})
        )
        async with c.stream(
            "POST", "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2_000, "stream": True},
        ) as s:  # fmt: skip
            lines = s.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            await state_until(c, lambda st: st["running"] == 2, "both requests placed")
            m_before = metric((await c.get("/metrics")).text, contract.START_TIME)
            r = await c.post("/admin/restart")
            assert r.status_code == 200 and r.json()["failed_in_flight"] == 2
            rest = [line async for line in lines]
        failed = await in_flight
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "engine_restarted"
        events = [line for line in rest if line.startswith("data: ")]
        assert events and "engine_restarted" in events[-1] and "[DONE]" not in events[-1]

        st = (await c.get("/admin/state")).json()
        assert st["free_tokens"] == st["largest_free_block_tokens"] == 100_000
        assert st["gaps"] == 1 and st["held"] == 0 and st["running"] == 0 and st["restarts"] == 1
        m_after = (await c.get("/metrics")).text
        assert metric(m_after, contract.START_TIME) >= m_before
        assert metric(m_after, contract.START_TIME) == st["started_at"]
        # And it serves again.
        ok = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


async def test_fault_injection_modes(engine_factory: Any) -> None:
    eng = engine_factory()
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=eng.url, timeout=10) as c:
        assert (await c.post("/admin/fault", json={"mode": "error500"})).status_code == 200
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.headers["content-type"].startswith("text/plain")
        assert (await c.get("/health")).status_code == 200  # scope "inference" spares health

        await c.post("/admin/fault", json={"mode": "garbage", "scope": "all"})
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200
        with pytest.raises(ValueError):
            r.json()
        assert (await c.get("/metrics")).status_code == 200 and b"garbage" in (
            await c.get("/health")
        ).content

        await c.post("/admin/fault", json={"mode": "hang"})
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json=body, timeout=0.3)
        assert (await c.get("/admin/fault")).json() == {"mode": "hang", "scope": "inference"}

        # Clearing the fault drops hung connections, as a dying process would.
        hung = asyncio.create_task(c.post("/v1/completions", json=body))
        await asyncio.sleep(0.1)
        assert not hung.done()
        await c.post("/admin/fault", json={"mode": "none"})
        with pytest.raises(httpx.RemoteProtocolError):
            await hung
        await c.post("/admin/fault", json={"mode": "hang"})

        bad = await c.post("/admin/fault", json={"mode": "explode"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
        await c.post("/admin/fault", json={"mode": "none"})
        assert (await c.post("/v1/completions", json=body)).status_code == 200


async def test_two_engines_in_one_process_have_separate_metrics(engine_factory: Any) -> None:
    a = engine_factory(name="a", capacity_tokens=10_000)
    b = engine_factory(name="b", capacity_tokens=20_000, allocator="paged")
    a.hold(1_000)
    async with httpx.AsyncClient(timeout=10) as c:
        ma = (await c.get(a.url + "/metrics")).text
        mb = (await c.get(b.url + "/metrics")).text
    assert metric(ma, contract.FREE) == 9_000 and metric(ma, contract.CAPACITY) == 10_000
    assert metric(mb, contract.FREE) == 20_000 and metric(mb, contract.CAPACITY) == 20_000


def test_subprocess_engine(engine_factory: Any) -> None:
    eng = engine_factory(
        "process", allocator="paged", capacity_tokens=4_096, block_size=32, name="proc"
    )
    r = httpx.post(
        eng.url + "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 3},
        timeout=10,
    )
    assert r.status_code == 200 and r.headers["x-engine-name"] == "proc"
    text = httpx.get(eng.url + "/metrics", timeout=10).text
    assert metric(text, contract.VLLM_CACHE_CONFIG, block_size="32", num_gpu_blocks="128") == 1
    eng.kill()
    assert not eng.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(eng.url + "/health", timeout=2)


def test_thread_engine_call_and_config_validation() -> None:
    eng = ThreadEngine(EngineConfig(port=0, speedup=1000.0, capacity_tokens=5_000)).start()
    try:
        assert eng.call(lambda e: e.allocator.allocate("x", 2_000)) == 0
        assert eng.state()["free_tokens"] == 3_000
    finally:
        eng.stop()
    with pytest.raises(ValueError):
        EngineConfig(allocator="buddy")
    with pytest.raises(ValueError):
        EngineConfig(speedup=0)
    with pytest.raises(SystemExit):
        main(["--capacity-tokens", "0"])
