"""The vLLM / SGLang / TGI modes of the simulated engine: the scheduler, and /metrics over HTTP.

The scheduler tests drive ``PagedCore.step`` with an injected time (no sleeping). The HTTP
tests run real servers on 127.0.0.1 with decode slowed to one token per 10 s, so the state
they compare cannot move during the ~0.1 s a scrape takes (a margin far above 5x).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import orjson
import pytest

from loadtest.engine.behaviours import BehaviourConfig, BehaviourServer
from loadtest.engine.behaviours.scheduler import PagedCore, SimRequest
from proxy.backends.registry import adapter_for

BS = 16


def core(blocks: int, max_num_seqs: int = 64, reserve_full: bool = False) -> PagedCore:
    # step_s 1, prefill instantaneous at t: tokens come one per step() call.
    return PagedCore(blocks, BS, max_num_seqs, 1.0, 1e12, reserve_full)


def req(prompt: int, max_tokens: int) -> SimRequest:
    return SimRequest(prompt, max_tokens, 0.0)


# --- the scheduler -------------------------------------------------------------------------------


def test_blocks_are_taken_lazily_for_prefill_then_one_per_boundary() -> None:
    c = core(100)
    r = req(20, 40)  # 2 blocks for the prompt; full demand would be 4
    c.submit(r, 0.0)
    assert (r.blocks, c.free_blocks) == (2, 98)
    c.step(1.0, 12)  # 32 tokens: still 2 blocks
    assert (r.tokens, r.blocks) == (32, 2)
    c.step(2.0, 1)  # the 33rd token needs a third block
    assert (r.tokens, r.blocks, c.free_blocks) == (33, 3, 97)


def test_fifo_queue_instead_of_failure_and_head_of_line() -> None:
    c = core(4)
    big, small = req(3 * BS, 10), req(BS, 10)
    first = req(2 * BS, 100)
    c.submit(first, 0.0)
    c.submit(big, 0.0)  # needs 3 blocks, 2 free: waits
    c.submit(small, 0.0)  # would fit, but FIFO keeps it behind big
    assert c.running == [first] and list(c.waiting) == [big, small]


def test_max_num_seqs_saturates_before_kv() -> None:
    c = core(1000, max_num_seqs=2)
    rs = [req(BS, 10) for _ in range(3)]
    for r in rs:
        c.submit(r, 0.0)
    assert len(c.running) == 2 and len(c.waiting) == 1
    assert c.free_blocks == 998  # plenty of KV: the slots ran out


def test_decode_without_a_free_block_preempts_the_newest_and_recomputes() -> None:
    c = core(4)
    old, new = req(2 * BS, 2 * BS), req(2 * BS, 2 * BS)  # 4 blocks each in the end
    c.submit(old, 0.0)
    c.submit(new, 0.0)
    assert c.free_blocks == 0
    c.step(1.0, 1)  # old needs a block: new (the most recent) is preempted
    assert c.stats.preemptions == 1
    assert c.running == [old] and list(c.waiting) == [new]
    assert old.blocks == 3 and new.blocks == 0 and new.generated == 0
    # new re-prefills prompt + generated tokens when it is admitted again
    c.step(2.0, 2 * BS - 1)
    assert old.done and new in c.running and new.blocks == 2
    assert c.stats.prompt_tokens == 3 * 2 * BS  # old once, new twice (recompute)


def test_freed_blocks_keep_their_prefix_and_count_as_free() -> None:
    c = core(10)
    r = req(4 * BS - 1, 1)  # 64 tokens in the end: 4 blocks
    c.submit(r, 0.0)
    c.step(1.0, 1)
    assert r.done
    st = c.state()
    assert st["free_tokens"] == 10 * BS and st["cached_free_tokens"] == 4 * BS
    assert c.usage == 0.0


def test_tgi_reserves_the_full_budget_and_never_preempts() -> None:
    c = core(10, reserve_full=True)
    a, b = req(BS, 4 * BS), req(BS, 4 * BS)  # 5 blocks each
    c.submit(a, 0.0)
    c.submit(b, 0.0)
    assert c.free_blocks == 0 and a.blocks == b.blocks == 5
    c.step(1.0, 4 * BS)
    assert a.done and b.done and c.stats.preemptions == 0


def test_abort_frees_running_and_queued_requests() -> None:
    c = core(4)
    a, b = req(4 * BS, 10), req(BS, 10)
    c.submit(a, 0.0)
    c.submit(b, 0.0)
    c.abort(b)
    c.abort(a)
    assert c.free_blocks == 4 and not c.running and not c.waiting


# --- over HTTP: /metrics read by the adapter equals the engine's own state ------------------------


@pytest.fixture
async def serve() -> AsyncIterator[list[BehaviourServer]]:
    servers: list[BehaviourServer] = []
    yield servers
    for s in servers:
        await s.stop()


async def started(servers: list[BehaviourServer], **kw: object) -> BehaviourServer:
    cfg = BehaviourConfig(model="m", block_size=BS, decode_tokens_per_s=0.1, **kw)  # type: ignore[arg-type]
    srv = BehaviourServer(cfg)
    await srv.start()
    servers.append(srv)
    return srv


async def wait_for(pred: Callable[[], bool]) -> None:
    """Poll the engine's state (it has no event to wait on for "all requests arrived")."""
    async with asyncio.timeout(5.0):
        while not pred():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("behaviour", "dp"), [("vllm", 1), ("vllm", 2), ("sglang", 1), ("sglang", 2), ("tgi", 1)]
)
async def test_metrics_parse_to_the_engines_own_state(
    serve: list[BehaviourServer], behaviour: str, dp: int
) -> None:
    srv = await started(
        serve, behaviour=behaviour, capacity_tokens=64 * BS, data_parallel=dp, max_num_seqs=3
    )
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        prompt = "alpha beta gamma delta " * 50  # ~200 tokens: 13 blocks each
        calls = [
            asyncio.create_task(
                client.post(
                    "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 64}
                )
            )
            for _ in range(8)
        ]
        await wait_for(
            lambda: sum(c["running"] + c["waiting"] for c in srv.front.state()["engines"]) == 8
        )
        text = (await client.get("/metrics")).text
        engines = srv.front.state()["engines"]
        for t in calls:
            t.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    r = adapter_for(behaviour).parse_metrics(text, 0.0)
    free = [e["free_tokens"] for e in engines]
    assert r.capacity_tokens == sum(e["capacity_tokens"] for e in engines) == dp * 64 * BS
    assert r.free_tokens == sum(free)
    assert r.largest_free_block_tokens == min(free)
    assert r.running == sum(e["running"] for e in engines)
    assert r.waiting == sum(e["waiting"] for e in engines) > 0  # queued, not refused
    assert r.queueing and r.engines == dp
    if behaviour == "vllm":
        assert r.engine_free_tokens == tuple(free)
        assert f'engine="{dp - 1}"' in text and 'kv_cache_size_tokens="' in text


@pytest.mark.parametrize("behaviour", ["vllm", "sglang"])
async def test_the_data_parallel_rank_header_pins_the_engine(
    serve: list[BehaviourServer], behaviour: str
) -> None:
    # Without the header the front end balances by queue length: the first request goes to
    # engine 0, the second to the empty engine 1. Pinned, both go to engine 1.
    srv = await started(serve, behaviour=behaviour, capacity_tokens=64 * BS, data_parallel=2)
    body = {"model": "m", "prompt": "alpha beta " * 20, "max_tokens": 64}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        calls = [
            asyncio.create_task(
                client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "1"})
            )
            for _ in range(2)
        ]
        await wait_for(lambda: srv.front.state()["engines"][1]["running"] == 2)
        assert srv.front.state()["engines"][0]["running"] == 0
        # Not a number: ignored (vLLM's reading); the front end picks the idle engine 0.
        loose = asyncio.create_task(
            client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "x"})
        )
        await wait_for(lambda: srv.front.state()["engines"][0]["running"] == 1)
        # A rank the server does not have: refused, never queued.
        bad = await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": "2"})
        for t in [*calls, loose]:
            t.cancel()
        await asyncio.gather(*calls, loose, return_exceptions=True)
    assert bad.status_code == 400
    assert "data_parallel_rank 2 is out of range [0, 2)" in bad.json()["error"]["message"]
    assert sum(e["waiting"] for e in srv.front.state()["engines"]) == 0


async def test_max_model_len_is_enforced_with_the_servers_own_answer(
    serve: list[BehaviourServer],
) -> None:
    expected = {
        "vllm": (400, "This model's maximum context length is 512 tokens"),
        "sglang": (400, "maximum context length of 512 tokens"),
        "tgi": (422, "must be <= 512"),
    }
    for behaviour, (status, words) in expected.items():
        srv = await started(serve, behaviour=behaviour, capacity_tokens=64 * BS, max_model_len=512)
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
            ans = await client.post(
                "/v1/completions", json={"model": "m", "prompt": "word " * 600, "max_tokens": 4}
            )
            models = (await client.get("/v1/models")).json()
        assert (ans.status_code, words in ans.text) == (status, True), ans.text
        info = adapter_for(behaviour).parse_models(orjson.dumps(models))
        assert info.ids == ("m",)
        assert info.max_model_len("m") == (None if behaviour == "tgi" else 512)
        assert srv.front.state()["engines"][0]["waiting"] == 0  # refused, never queued


async def test_vllm_sleep_shows_in_metrics_and_is_not_read_as_empty(
    serve: list[BehaviourServer],
) -> None:
    srv = await started(serve, behaviour="vllm", capacity_tokens=64 * BS)
    async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
        assert (await client.post("/sleep")).status_code == 200
        text = (await client.get("/metrics")).text
        r = adapter_for("vllm").parse_metrics(text, 0.0)
        assert 'sleep_state="awake"} 0.0' in text
        assert r.sleeping and r.largest_free_block_tokens == 0
        await client.post("/wake_up")
        r = adapter_for("vllm").parse_metrics((await client.get("/metrics")).text, 0.0)
        assert not r.sleeping and r.free_tokens == 64 * BS


async def test_streaming_delivers_every_token(serve: list[BehaviourServer]) -> None:
    cfg = BehaviourConfig(
        behaviour="vllm", model="m", block_size=BS, capacity_tokens=64 * BS, speedup=50.0
    )
    srv = BehaviourServer(cfg)
    await srv.start()
    serve.append(srv)
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 40,
            "stream": True,
        }
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(
        (orjson.loads(ln[6:])["choices"][0]["delta"].get("content") or "") for ln in lines[:-1]
    )
    assert len(text.split()) == 40
    assert srv.front.state()["engines"][0]["free_tokens"] == 64 * BS


async def test_collector_reads_a_mixed_fleet_by_kind(serve: list[BehaviourServer]) -> None:
    """vLLM (data parallel 2), SGLang and TGI engines scraped by the real collector."""
    from proxy.backends.collector import Collector
    from proxy.config import Config
    from proxy.state import InProcessStore

    kinds = {"v": ("vllm", 2), "s": ("sglang", 1), "t": ("tgi", 1)}
    servers = {
        name: await started(
            serve, behaviour=b, capacity_tokens=32 * BS, data_parallel=dp, max_model_len=400
        )
        for name, (b, dp) in kinds.items()
    }
    async with httpx.AsyncClient(timeout=30) as client:
        calls = [
            asyncio.create_task(
                client.post(
                    f"{srv.url}/v1/completions",
                    json={"model": "m", "prompt": "one two " * 60, "max_tokens": 8},
                )
            )
            for srv in servers.values()
            for _ in range(3)
        ]
        await wait_for(
            lambda: all(
                sum(e["running"] for e in s.front.state()["engines"]) == 3 for s in servers.values()
            )
        )
        cfg = Config.model_validate(
            {
                "backends": [
                    {"name": n, "url": s.url, "kind": kinds[n][0]} for n, s in servers.items()
                ]
            }
        )
        store = InProcessStore()
        collector = Collector(cfg, store, "gw")
        try:
            await collector.scrape_once()
            truth = {n: s.front.state()["engines"] for n, s in servers.items()}
        finally:
            await collector.stop()
        for t in calls:
            t.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    states = await store.read(list(servers), 0.0)
    for name in servers:
        report = states[name].report
        engines = truth[name]
        assert report is not None, states[name].status_reason
        assert report.free_tokens == sum(e["free_tokens"] for e in engines) < report.capacity_tokens
        assert report.running == 3 and report.queueing
        info = collector.models(name)
        assert info is not None and info.ids == ("m",)
    assert states["v"].report is not None and states["v"].report.engines == 2


def test_cli_starts_a_vllm_engine_and_refuses_bad_flags() -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "proxy.cli", "engine", "--behaviour", "vllm", "--port", "0"]
    argv += ["--data-parallel", "2", "--capacity-tokens", "4096", "--model", "m"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "(vllm) listening on" in line, line
        url = line.split("listening on ", 1)[1].strip()
        text = httpx.get(f"{url}/metrics", timeout=10).text
        r = adapter_for("vllm").parse_metrics(text, 0.0)
        assert (r.capacity_tokens, r.engines) == (8192, 2)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    bad = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "engine", "--behaviour", "tgi", "--data-parallel", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "data-parallel" in bad.stderr


@pytest.mark.parametrize(("allocator", "kind"), [("contiguous", "contiguous"), ("paged", "paged")])
async def test_default_kvroute_mode_metrics_parse_to_its_own_state(
    allocator: str, kind: str
) -> None:
    """The default behaviour: the kvroute gauges, read by the kvroute adapter."""
    from loadtest.engine.server import EngineConfig, EngineServer

    srv = EngineServer(EngineConfig(port=0, allocator=allocator, capacity_tokens=10_000))
    await srv.start()
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
            await client.post("/admin/hold", json={"tokens": 1_000, "count": 3})
            text = (await client.get("/metrics")).text
        fig = srv.engine.figures()
    finally:
        await srv.stop()
    r = adapter_for(kind).parse_metrics(text, 0.0)
    assert (r.capacity_tokens, r.free_tokens, r.largest_free_block_tokens) == (
        fig["capacity_tokens"],
        fig["free_tokens"],
        fig["largest_free_block_tokens"],
    )
    assert r.free_tokens < r.capacity_tokens and not r.queueing


async def test_vllm_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(
    serve: list[BehaviourServer],
) -> None:
    # As vLLM's prompt_tokens_details.cached_tokens: nothing the first time, the prompt's full
    # blocks the second.
    cfg = BehaviourConfig(model="m", block_size=BS, capacity_tokens=256 * BS, speedup=100.0)
    srv = BehaviourServer(cfg)
    await srv.start()
    serve.append(srv)
    body = {
        "model": "m",
        "prompt": "alpha beta gamma delta " * 50,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        for _ in range(2):
            r = await client.post("/v1/completions", json=body)
            usage = [
                orjson.loads(line[6:])["usage"]
                for line in r.text.splitlines()
                if line.startswith("data: {") and '"usage":{' in line
            ]
            seen.append(usage[-1])
    assert seen[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt = seen[1]["prompt_tokens"]
    assert seen[1]["prompt_tokens_details"]["cached_tokens"] == prompt // BS * BS
