"""The v1 scheduler model (``--scheduler v1``): budget, chunks, running first, preemption.

The pure tests drive ``V1Core.schedule`` / ``finish`` with an injected clock (no sleeping);
one test runs a real server on 127.0.0.1 and streams through the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from loadtest.engine.behaviours import BehaviourConfig, BehaviourServer
from loadtest.engine.behaviours.scheduler import SimRequest
from loadtest.engine.behaviours.stream_pacing import Pacing
from loadtest.engine.behaviours.v1_scheduler import StepPlan, V1Core

BS = 16


def core(blocks: int = 10_000, budget: int = 64, max_num_seqs: int = 64) -> V1Core:
    # 1 s a step plus 1 ms a token: step times are easy to read.
    return V1Core(blocks, BS, max_num_seqs, budget, 1.0, 0.001)


def req(prompt: int, max_tokens: int) -> SimRequest:
    return SimRequest(prompt, max_tokens, 0.0)


def run_step(c: V1Core, now: float) -> tuple[StepPlan, float]:
    plan = c.schedule(now)
    end = now + c.step_time(plan)
    c.finish(plan, end)
    return plan, end


def test_every_step_stays_within_the_token_budget() -> None:
    c = core(budget=64)
    for r in (req(100, 5), req(30, 20), req(200, 3), req(10, 40)):
        c.submit(r, 0.0)
    now, plans = 0.0, []
    while c.running or c.waiting:
        plan, now = run_step(c, now)
        plans.append(plan)
    assert all(0 < p.tokens <= 64 for p in plans)
    # Nothing is lost: every request got all its tokens.
    assert c.stats.generation_tokens == 5 + 20 + 3 + 40


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_at_its_end() -> None:
    c = core(budget=64)
    r = req(150, 3)
    c.submit(r, 0.0)
    chunks = []
    now = 0.0
    while r.first_token_at is None:
        plan, now = run_step(c, now)
        chunks.append(dict((id(q), n) for q, n in plan.scheduled)[id(r)])
    assert chunks == [64, 64, 22]
    # Blocks follow the chunks: 150 tokens hold 10 blocks, never the full demand at once.
    assert r.blocks == 10 and r.generated == 1


def test_running_requests_are_served_before_waiting_ones() -> None:
    c = core(budget=4)
    old = req(4, 10)
    c.submit(old, 0.0)
    run_step(c, 0.0)  # old prefilled, first token sampled
    new = req(40, 10)
    c.submit(new, 1.0)
    plan = c.schedule(2.0)
    # The decode takes 1 token first; the new prompt gets the 3 left, as a chunk.
    assert plan.scheduled == [(old, 1), (new, 3)]


def test_the_newest_running_request_is_preempted_when_blocks_run_out() -> None:
    c = core(blocks=4, budget=1000)
    first, second = req(2 * BS, 100), req(2 * BS - 1, 100)
    c.submit(first, 0.0)
    c.submit(second, 0.0)
    now = 0.0
    while c.stats.preemptions == 0:
        _plan, now = run_step(c, now)
    assert c.running == [first] and list(c.waiting) == [second]
    assert second.blocks == 0 and second.kv_computed == 0 and second.preempted == 1
    # The older request got the freed blocks and keeps decoding.
    plan = c.schedule(now)
    assert plan.scheduled == [(first, 1)] and first.blocks == 3


def test_a_step_that_preempted_admits_nobody() -> None:
    c = core(blocks=4, budget=1000)
    a, b = req(2 * BS, 100), req(2 * BS - 1, 100)
    c.submit(a, 0.0)
    c.submit(b, 0.0)
    run_step(c, 0.0)
    late = req(1, 1)
    c.submit(late, 0.0)
    plan = c.schedule(1.0)  # b's first decode needs a 3rd block for it: none free
    while plan.preempted == 0:
        c.finish(plan, 1.0)
        plan = c.schedule(1.0)
    assert late in c.waiting and all(q is not late for q, _n in plan.scheduled)


def test_max_num_seqs_caps_the_running_batch() -> None:
    c = core(max_num_seqs=2)
    rs = [req(BS, 10) for _ in range(3)]
    for r in rs:
        c.submit(r, 0.0)
    plan = c.schedule(0.0)
    assert [q for q, _n in plan.scheduled] == rs[:2] and list(c.waiting) == [rs[2]]


def test_a_step_lasts_longer_with_more_tokens() -> None:
    c = core(budget=64)
    c.submit(req(60, 2), 0.0)
    big = c.schedule(0.0)
    c.finish(big, c.step_time(big))
    small = c.schedule(1.0)
    assert c.step_time(big) == pytest.approx(1.060) and c.step_time(small) == pytest.approx(1.001)


def test_a_request_that_arrived_after_the_step_began_waits_for_the_next() -> None:
    c = core()
    r = SimRequest(10, 1, 5.0)
    c.submit(r, 5.0)
    assert not c.schedule(4.0).scheduled and c.schedule(5.0).scheduled


def pulled(prompt: int, max_tokens: int, transfer_tokens_per_s: float) -> SimRequest:
    """A decode server's request whose prompt KV a prefill server computed (``--pd-role``)."""
    r = req(prompt, max_tokens)
    r.transfer_tokens_per_s = transfer_tokens_per_s
    return r


def test_a_pulled_prompt_takes_its_blocks_at_once_and_no_budget_until_the_transfer_ends() -> None:
    c = core(budget=64)
    r = pulled(150, 3, transfer_tokens_per_s=100.0)  # 1.5 s of transfer
    local = req(10, 2)
    c.submit(r, 0.0)
    c.submit(local, 0.0)
    plan = c.schedule(0.0)
    # Admitted with the whole prompt's 10 blocks, never chunked: the request behind it runs.
    assert r in c.running and r.blocks == 10 and plan.scheduled == [(local, 10)]
    c.finish(plan, 1.0)
    assert all(q is not r for q, _n in c.schedule(1.0).scheduled)
    # The transfer ended: the prompt's last token is recomputed and samples the first token.
    plan = c.schedule(1.5)
    assert (r, 1) in plan.scheduled
    c.finish(plan, 2.0)
    assert r.first_token_at == 2.0 and r.generated == 1 and r.blocks == 10


def test_a_preempted_pulled_request_recomputes_its_prompt_in_chunks() -> None:
    c = core(blocks=12, budget=64)
    old = req(2 * BS - 1, 100)
    c.submit(old, 0.0)
    _plan, now = run_step(c, 0.0)
    r = pulled(150, 20, transfer_tokens_per_s=1e9)
    c.submit(r, now)
    # r takes the last 10 blocks; the older request's next block preempts it (the newest).
    plans = [run_step(c, now)[0]]
    plans.append(run_step(c, now + 1)[0])
    assert r.preempted == 1 and r.kv_computed == 0 and plans[-1].preempted == 1
    # Its pulled KV is gone: it is computed here now, in chunks (the budget less the decode).
    plan, _end = run_step(c, now + 2)
    assert plan.scheduled == [(old, 1), (r, 63)] and r.blocks == 4


def test_a_v1_core_sleeps_until_a_pulled_prompts_transfer_ends() -> None:
    async def scenario() -> float:
        c = V1Core(1_000, BS, 8, 64, 0.001, 0.0)
        c.start()
        loop = asyncio.get_running_loop()
        r = pulled(100, 2, transfer_tokens_per_s=1_000.0)  # 0.1 s of transfer
        r.arrived_at = loop.time()
        c.submit(r, r.arrived_at)
        while not r.done:
            r.changed.clear()
            await asyncio.wait_for(r.changed.wait(), 5)
        await c.stop()
        assert r.first_token_at is not None
        return r.first_token_at - r.arrived_at

    assert 0.1 <= asyncio.run(scenario()) < 1.0


def test_pacing_cuts_events_and_holds_until_a_full_one() -> None:
    assert Pacing(1).pieces(3) == [1, 1, 1] and Pacing(0).pieces(3) == [3]
    assert Pacing(4).pieces(10) == [4, 4, 2]
    four = Pacing(4)
    # The first token goes at once; then only full events, or the last tokens.
    assert four.ready(0, 1, 100) and not four.ready(1, 4, 100) and four.ready(1, 5, 100)
    assert four.ready(98, 100, 100)


# --- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[BehaviourServer]:
    cfg = BehaviourConfig(
        behaviour="vllm",
        model="m",
        block_size=BS,
        capacity_tokens=512 * BS,
        scheduler="v1",
        step_base_ms=10.0,
        speedup=10.0,
    )
    srv = BehaviourServer(cfg)
    await srv.start()
    yield srv
    await srv.stop()


def samples(text: str, name: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    )


async def test_a_v1_engine_streams_one_event_per_token_and_exports_vllm_metrics(
    server: BehaviourServer,
) -> None:
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hello " * 300}],
        max_tokens=25,
        stream=True,
    )
    deltas = [c.choices[0].delta.content async for c in stream if c.choices]
    await client.close()
    # The role opener, then exactly one event per generated token.
    assert deltas[0] == "" and len(deltas[1:]) == 25 and all(deltas[1:])
    async with httpx.AsyncClient(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    assert samples(text, "vllm:generation_tokens_total") == 25
    assert samples(text, "vllm:prompt_tokens_total") >= 300
    assert samples(text, "vllm:time_to_first_token_seconds_count") == 1
    assert samples(text, "vllm:num_requests_running") == 0
    assert samples(text, "vllm:num_preemptions_total") == 0
    engine = server.front.cores[0]
    assert isinstance(engine, V1Core) and engine.steps >= 25
