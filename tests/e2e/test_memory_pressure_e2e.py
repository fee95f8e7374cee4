"""Memory pressure on vLLM-mode engines through the real gateway (docs/memory-pressure.md).

Real engine processes (paged blocks, lazy growth, preemption with recompute), the gateway
served by uvicorn, httpx streaming clients. Each test states what the code before the
projection did differently.
"""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import httpx

from loadtest.engine.behaviours.eos import marker
from tests.support.behaviours import engine_state, engines
from tests.support.gateway import gateway_cfg, run_gateway, wait_until

ENGINE = {"block_size": 16, "speedup": 10, "model": "m"}
PROMPT = "word " * 40


def backends(urls: dict[str, str]) -> list[dict[str, Any]]:
    # The engines decode 30 tokens/s at speedup 10: 300 tokens/s as the gateway sees it.
    return [
        {"name": n, "url": u, "kind": "vllm", "decode_tokens_per_s": 300} for n, u in urls.items()
    ]


def fleet(gw: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(gw + "/fleet", timeout=10).json()
    return body


def preemptions(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_preemptions_total")
    )


def stream(url: str, max_tokens: int, eos: int | None = None) -> tuple[int, int, str]:
    """(status, content events, finish reason) of one streamed completion that ended well."""
    prompt = PROMPT + (marker(eos) if eos is not None else "")
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    events, finish, done = 0, "", False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            done = done or line == "data: [DONE]"
            if line.startswith("data: {"):
                events += '"text"' in line
                reason = json.loads(line[6:])["choices"][0].get("finish_reason")
                finish = reason or finish
        return (r.status_code if done else 0), events, finish


def answer(url: str, max_tokens: int, eos: int) -> tuple[int, str, int]:
    """(status, finish reason, usage.completion_tokens) of one non-streamed completion."""
    body = {"model": "m", "prompt": PROMPT + marker(eos), "max_tokens": max_tokens}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    data = r.json()
    return r.status_code, data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]


def burst(url: str, n: int, max_tokens: int, eos: int | None = None) -> list[tuple[int, int, str]]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: stream(url, max_tokens, eos), range(n)))


def test_requests_whose_decodes_would_collide_are_held_not_preempted() -> None:
    # 1,024 tokens of KV; each request grows to ~440: two fit at their peak, six arrive.
    # Before: after queue.max_wait_s (0.5 s) the other four joined the engine's queue, it
    # admitted them on their prompts alone and preempted as the decodes grew.
    with engines(("vllm", "v", {"capacity_tokens": 1024, **ENGINE})) as urls:
        cfg = gateway_cfg(backends(urls), memory_pressure={"max_hold_s": 60})
        with run_gateway(cfg) as gw:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            answers = burst(gw, 6, max_tokens=400)
            assert [(status, finish) for status, _, finish in answers] == [(200, "length")] * 6
            assert preemptions(urls["v"]) == 0
            # They waited at the gateway instead (the admission queue's own histogram).
            metrics = httpx.get(gw + "/metrics", timeout=10).text
            held = [
                ln
                for ln in metrics.splitlines()
                if ln.startswith("kvroute_queue_wait_seconds_count")
            ]
            assert held and float(held[0].rsplit(" ", 1)[1]) >= 1


def test_learned_output_lengths_let_more_requests_run_at_once() -> None:
    # Clients ask for 600 tokens and write 20: after a few answers the gateway counts ~20.
    # Four requests at full demand (4 x ~640) exceed 2,048 tokens: before, at most three ran
    # together and the fourth was held until one ended. Decoding at 90 tokens/s, the four
    # run together for ~3 s: time for the state poll to see it on a loaded machine.
    slow = {**ENGINE, "speedup": 3}
    with engines(("vllm", "v", {"capacity_tokens": 2048, **slow})) as urls:
        cfg = gateway_cfg(
            backends(urls),
            queue={"max_wait_s": 20},
            memory_pressure={"min_samples": 5, "max_hold_s": 20},
        )
        with run_gateway(cfg) as gw:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            for _ in range(5):
                status, events, finish = stream(gw, max_tokens=600, eos=20)
                assert (status, finish) == (200, "stop") and 1 <= events <= 20
            learned = fleet(gw)["memory_pressure"]["learned_output"]["model:m|short"]
            assert learned["samples"] == 5 and 0 < learned["ratio"] <= 30 / 600
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                running = pool.submit(burst, gw, 4, 600, 300)
                wait_until(
                    lambda: engine_state(urls["v"])[0]["running"] == 4,
                    timeout_s=30,
                    what="four running together",
                )
                assert all(status == 200 for status, _, _ in running.result())
            assert preemptions(urls["v"]) == 0


def test_non_streamed_answers_teach_the_output_length_too() -> None:
    # Clients that do not stream: the answer's usage.completion_tokens is the server's own
    # count. Before, only streams taught the ratios: these clients stayed at max_tokens.
    with engines(("vllm", "v", {"capacity_tokens": 4096, **ENGINE})) as urls:
        cfg = gateway_cfg(backends(urls), memory_pressure={"min_samples": 5})
        with run_gateway(cfg) as gw:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            for _ in range(4):
                assert answer(gw, max_tokens=600, eos=20) == (200, "stop", 20)
            # One that ends at max_tokens counts as all of it (ratio 1), not as its text.
            assert answer(gw, max_tokens=600, eos=700) == (200, "length", 600)
            learned = fleet(gw)["memory_pressure"]["learned_output"]["model:m|short"]
            # The 0.9 quantile of four 20/600 and one 600/600 is the longest.
            assert learned == {"ratio": 1.0, "samples": 5}
            # Six more: the quantile (the 10th of 11) is a short one's again.
            for _ in range(6):
                assert answer(gw, max_tokens=600, eos=20)[0] == 200
            learned = fleet(gw)["memory_pressure"]["learned_output"]["model:m|short"]
            assert learned == {"ratio": 20 / 600, "samples": 11}
            # Nothing is left in flight once the answers are back.
            assert fleet(gw)["backends"][0]["memory_pressure"]["inflight_tracked"] == 0


def test_a_class_without_its_own_samples_counts_at_max_tokens_not_at_another_classs() -> None:
    # Chats teach "20 of 600" (demand ~645: short). A document (~805: long) has no samples of its
    # own: it counts at its max_tokens. Before, it fell back to the model-wide ratio, the
    # chats' (chats finish first), and was projected at 20: two such documents then
    # outgrew an engine and it preempted.
    slow = {**ENGINE, "speedup": 2}
    with engines(("vllm", "v", {"capacity_tokens": 8192, **slow})) as urls:
        cfg = gateway_cfg(
            backends(urls),
            memory_pressure={"min_samples": 5},
            routing={"long_threshold_tokens": 700},
        )
        with run_gateway(cfg) as gw:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            for _ in range(5):
                assert answer(gw, max_tokens=600, eos=20)[0] == 200
            body = {"model": "m", "prompt": "word " * 200 + marker(600), "max_tokens": 600}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                document = pool.submit(httpx.post, gw + "/v1/completions", json=body, timeout=120)
                node = lambda: fleet(gw)["backends"][0]["memory_pressure"]  # noqa: E731
                wait_until(lambda: node()["inflight_tracked"] == 1, what="the document placed")
                # Its prompt (~200 tokens) and all of its 600: not 200 + 20.
                assert node()["projected_peak_tokens"] >= 600 + 150
                assert document.result().status_code == 200
            learned = fleet(gw)["memory_pressure"]["learned_output"]
            assert set(learned) == {"model:m|short", "model:m|long"}


def test_preemptions_tighten_the_nodes_budget_and_the_advice_says_so() -> None:
    with engines(("vllm", "v", {"capacity_tokens": 1024, **ENGINE})) as urls:
        cfg = gateway_cfg(backends(urls))
        with run_gateway(cfg) as gw:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            # A request through the gateway: the node's counter as it was (the reference).
            assert stream(gw, max_tokens=8)[0] == 200
            node = fleet(gw)["backends"][0]
            assert node["memory_pressure"]["kv_budget_fraction"] == 1.0
            # Another client overloads the engine behind the gateway's back: it preempts.
            assert all(s == 200 for s, _, _ in burst(urls["v"], 5, max_tokens=400))
            assert preemptions(urls["v"]) > 0
            wait_until(
                lambda: fleet(gw)["backends"][0]["report"]["preemptions"] > 0,
                what="the rise reported",
            )
            assert stream(gw, max_tokens=8)[0] == 200
            pressure = fleet(gw)["backends"][0]["memory_pressure"]
            assert pressure["kv_budget_fraction"] < 1.0 and pressure["preemption_rises"] == 1
            advice = httpx.get(gw + "/fleet/advice", timeout=10).json()["memory_pressure"]
            assert "v" in advice["tightened"] and "scale up" in advice["reason"]


def test_a_data_parallel_servers_engine_is_pinned_where_the_request_fits() -> None:
    # Two engines of 1,200 tokens behind one URL. A document (740 tokens at its end) runs on
    # engine 0 and a chat (240) on engine 1: one request each. A second document fits only
    # beside the chat. The server's front end counts requests, not KV: a tie, so it would
    # put the document on engine 0 beside the first (1,480 tokens: a preemption), and the
    # gateway's estimate of which engine held what (before pinning) held it until the first
    # ended. Pinned with X-data-parallel-rank, it runs on engine 1.
    slow = {**ENGINE, "speedup": 5}  # 150 tokens/s: the chat lasts ~1.3 s, a document ~4.7 s
    dp = {"capacity_tokens": 1200, "data_parallel": 2, **slow}
    with engines(("vllm", "v", dp)) as urls:
        bes = [{**b, "decode_tokens_per_s": 150} for b in backends(urls)]
        cfg = gateway_cfg(bes, memory_pressure={"max_hold_s": 60})
        with run_gateway(cfg) as gw, concurrent.futures.ThreadPoolExecutor(3) as pool:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")

            def running() -> list[int]:
                return [e["running"] for e in engine_state(urls["v"])]

            first = pool.submit(stream, gw, 700)
            wait_until(lambda: running() == [1, 0], what="the first document on engine 0")
            chat = pool.submit(stream, gw, 200)
            wait_until(lambda: running() == [1, 1], what="the chat on engine 1")
            second = pool.submit(stream, gw, 700)
            answers = [f.result() for f in (first, chat, second)]
            mp = fleet(gw)["backends"][0]["memory_pressure"]
        assert [(status, finish) for status, _, finish in answers] == [(200, "length")] * 3
        state = engine_state(urls["v"])
        # Engine 1 served the chat and the second document; nothing was preempted.
        assert [e["finished"] for e in state] == [1, 2]
        assert preemptions(urls["v"]) == 0
        assert mp["data_parallel_routing"] == "gateway"


def test_data_parallel_routing_server_leaves_the_engine_to_the_front_end() -> None:
    dp = {"capacity_tokens": 1024, "data_parallel": 2, **ENGINE}
    with engines(("vllm", "v", dp)) as urls:
        bes = [{**b, "data_parallel_routing": "server"} for b in backends(urls)]
        with run_gateway(gateway_cfg(bes)) as gw:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            # Pinned, the gateway would pick engine 0 for both (most room, then fewest
            # flights, then rank 0: each is done before the next). Unpinned, the front
            # end's choice shows: with a header the engine would answer 400 for rank 5.
            headers = {"X-data-parallel-rank": "5"}
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 5}
            r = httpx.post(gw + "/v1/completions", json=body, headers=headers, timeout=60)
            mp = fleet(gw)["backends"][0]["memory_pressure"]
        # The client's own header passes through untouched when the gateway does not pin.
        assert r.status_code == 400 and "out of range" in r.text
        assert mp["data_parallel_routing"] == "server" and "inflight_per_engine" not in mp


def second_document(max_tokens: int) -> tuple[list[tuple[int, int, str]], float, str]:
    """Answers, preemptions and the gateway's metrics when a second document arrives.

    2,048 tokens of KV. The first document (~1,040 tokens at its end) has written 600 of its
    1,000 tokens (~650 held) when the second (``max_tokens``) arrives; asserted here: both
    run together while the first is still writing (each then ends well).
    """
    slow = {**ENGINE, "speedup": 5}  # 150 tokens/s: the first document lasts ~6.7 s
    with engines(("vllm", "v", {"capacity_tokens": 2048, **slow})) as urls:
        bes = [{**b, "decode_tokens_per_s": 150} for b in backends(urls)]
        cfg = gateway_cfg(bes, queue={"max_wait_s": 30}, memory_pressure={"max_hold_s": 60})
        with run_gateway(cfg) as gw, concurrent.futures.ThreadPoolExecutor(2) as pool:
            wait_until(lambda: fleet(gw)["backends"][0]["report"] is not None, what="report")
            first = pool.submit(stream, gw, 1000)
            wait_until(
                lambda: engine_state(urls["v"])[0]["used_tokens"] >= 650,
                timeout_s=30,
                what="the first document 600 tokens in",
            )
            second = pool.submit(stream, gw, max_tokens)
            wait_until(
                lambda: engine_state(urls["v"])[0]["running"] == 2,
                timeout_s=30,
                what="both documents running together",
            )
            answers = [first.result(), second.result()]
            metrics = httpx.get(gw + "/metrics", timeout=10).text
        return answers, preemptions(urls["v"]), metrics


def test_a_request_that_fits_beside_the_projected_peak_starts_though_it_does_not_fit_now() -> None:
    # The second document (~1,540 at its end) fits neither in what is free now (~1,400) nor
    # beside the first at full demand, but never needs to: the first ends before the second
    # has written 400 tokens (~1,500 together at most, so no preemption). Before: a lazily
    # allocating node's room was the smaller of what the projection left and what was free
    # now, so it was held until the first ended (both never ran together).
    answers, preempted, _ = second_document(1500)
    assert [(status, finish) for status, _, finish in answers] == [(200, "length")] * 2
    assert preempted == 0


def test_the_projection_decides_the_fit_not_the_rule_of_full_demands() -> None:
    # The second document (~1,240) fits what is free now and the projected peak, not beside
    # the first at full demand (2,280 > 2,048). Before: the ranking placed it on its
    # projection, the store's reserve then refused it at full demand, and it reached the
    # engine as a request that "fits nowhere now", sent to the backend's queue.
    answers, preempted, metrics = second_document(1200)
    assert [(status, finish) for status, _, finish in answers] == [(200, "length")] * 2
    assert preempted == 0
    queued = [
        ln for ln in metrics.splitlines() if ln.startswith("kvroute_queued_at_backend_total{")
    ]
    assert all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in queued), queued
