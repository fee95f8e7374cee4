"""Disaggregated prefill and decode through the real gateway, on simulated vLLM servers with
roles (``kvroute engine --behaviour vllm --pd-role prefill|decode``): both steps, streaming
and not, and the faults of each step. After each: no prefill server holds blocks, and the
gateway holds no reservation."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest

from loadtest.engine.behaviours.eos import marker
from tests.support.behaviours import engines, server_state, start
from tests.support.gateway import (
    all_reported,
    fleet_backends,
    fleet_state,
    gateway_cfg,
    run_gateway,
    wait_until,
)

FAST = {"speedup": 20, "block_size": 16}
# A prompt well over the conditional-disaggregation threshold set below (64 tokens).
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 40


def long_prompt(i: int) -> str:
    """Another long prompt (a decode server that served one caches it: no prefill needed)."""
    return f"request {i}: " + LONG_PROMPT


SHORT_PROMPT = "hi there"


def pd_backends(urls: dict[str, str]) -> list[dict[str, Any]]:
    """Names starting with p are prefill servers, with d decode servers."""
    role = {"p": "prefill", "d": "decode"}
    return [{"name": n, "url": u, "kind": "vllm", "role": role[n[0]]} for n, u in urls.items()]


def pd_cfg(urls: dict[str, str], **sections: Any) -> Any:
    sections.setdefault("disaggregation", {"min_uncached_prompt_tokens": 64})
    return gateway_cfg(pd_backends(urls), **sections)


def dead_backend(url: str) -> dict[str, Any]:
    return {"name": "p0", "url": url, "kind": "vllm", "role": "prefill"}


def nothing_held(gw: str, urls: dict[str, str]) -> bool:
    """No prefill server holds blocks; the gateway holds no reservation; nothing runs."""
    if any(server_state(u)["kv_holds"] for n, u in urls.items() if n.startswith("p")):
        return False
    if any(
        sum(e["running"] + e["waiting"] for e in server_state(u)["engines"]) for u in urls.values()
    ):
        return False
    return all(
        b["overlay"]["reserved_tokens"] == 0 and b["overlay"]["inflight"] == 0
        for b in fleet_backends(gw)
    )


def ask(gw: str, prompt: str, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(gw + "/v1/completions", json=body, timeout=30)


def test_both_steps_non_streaming_and_streaming_and_short_prompts_skip_prefill() -> None:
    specs = [
        ("vllm", "p1", {"pd_role": "prefill", **FAST}),
        ("vllm", "d1", {"pd_role": "decode", **FAST}),
    ]
    with engines(*specs) as urls:
        with run_gateway(pd_cfg(urls)) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            roles = {b["name"]: b["serving_role"] for b in fleet_backends(gw)}
            assert roles == {"p1": "prefill", "d1": "decode"}
            r = ask(gw, LONG_PROMPT)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-backend"] == "d1"
            assert r.headers["x-kvroute-prefill-backend"] == "p1"
            assert "kv_transfer_params" not in r.json()
            assert r.json()["usage"]["completion_tokens"] == 8
            assert server_state(urls["p1"])["kv_pulled"] == 1
            # Another prompt: d1 caches the first now, so it would need no prefill server.
            other = LONG_PROMPT.replace("fox", "cat")
            body = {"model": "sim-model", "prompt": other, "max_tokens": 6, "stream": True}
            with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=30) as s:
                assert s.status_code == 200
                assert s.headers["x-kvroute-prefill-backend"] == "p1"
                text = "".join(s.iter_text())
            assert text.rstrip().endswith("data: [DONE]")
            assert server_state(urls["p1"])["kv_pulled"] == 2
            # Short: straight to the decode server; never to the prefill-only server.
            for _ in range(3):
                r = ask(gw, SHORT_PROMPT)
                assert r.status_code == 200 and r.headers["x-kvroute-backend"] == "d1"
                assert "x-kvroute-prefill-backend" not in r.headers
            assert server_state(urls["p1"])["kv_pulled"] == 2
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")
            metrics = httpx.get(gw + "/metrics").text
            assert 'kvroute_two_step_total{result="ok",step="prefill"} 2.0' in metrics
            assert 'kvroute_two_step_total{result="skipped",step="prefill"} 3.0' in metrics


def test_a_dead_prefill_server_and_a_lost_transfer_move_step_1_elsewhere() -> None:
    specs = [
        # p1's hold ends before any pull can come (the KV is gone before step 2).
        ("vllm", "p1", {"pd_role": "prefill", "kv_hold_timeout_s": 0.001, **FAST}),
        ("vllm", "p2", {"pd_role": "prefill", **FAST}),
        ("vllm", "d1", {"pd_role": "decode", **FAST}),
        ("vllm", "d2", {"pd_role": "decode", **FAST}),
    ]
    with engines(*specs) as urls:
        with run_gateway(pd_cfg(urls)) as gw:
            wait_until(lambda: all_reported(gw, 4), what="reports")
            for i in range(2):
                r = ask(gw, long_prompt(i))
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-prefill-backend"] == "p2"
                # p1 first (no backlog anywhere: by name), its KV gone before the pull.
                assert r.headers["x-kvroute-prefill-attempts"] == "2"
            assert server_state(urls["p2"])["kv_pulled"] == 2
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")
    # A prefill server that is not running at all: connection refused, the next one serves.
    dead, dead_url = start("vllm", "p0", pd_role="prefill", **FAST)
    dead.terminate()
    dead.wait(10)
    specs = [
        ("vllm", "p1", {"pd_role": "prefill", **FAST}),
        ("vllm", "d1", {"pd_role": "decode", **FAST}),
    ]
    with engines(*specs) as urls:
        backends = [*pd_backends(urls), dead_backend(dead_url)]
        cfg = gateway_cfg(backends, disaggregation={"min_uncached_prompt_tokens": 64})
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            for i in range(3):
                r = ask(gw, long_prompt(i))
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-prefill-backend"] == "p1"
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")


def test_every_prefill_server_down_the_decode_server_prefills_itself() -> None:
    dead, dead_url = start("vllm", "p0", pd_role="prefill", **FAST)
    dead.terminate()
    dead.wait(10)
    with engines(("vllm", "d1", {"pd_role": "decode", **FAST})) as urls:
        backends = [*pd_backends(urls), dead_backend(dead_url)]
        cfg = gateway_cfg(backends, disaggregation={"min_uncached_prompt_tokens": 64})
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 1), what="reports")
            r = ask(gw, LONG_PROMPT)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-backend"] == "d1"
            assert "x-kvroute-prefill-backend" not in r.headers
            metrics = httpx.get(gw + "/metrics").text
            assert 'kvroute_two_step_total{result="failed",step="prefill"} 1.0' in metrics
            assert 'kvroute_two_step_total{result="alone",step="decode"} 1.0' in metrics
            # One request, counted once.
            assert (
                'kvroute_requests_total{backend="d1",class="short",outcome="success"} 1.0'
                in metrics
            )
            assert 'outcome="unavailable"' not in metrics.split("kvroute_requests_total")[1]


def test_decode_servers_refusing_out_of_memory_keep_the_prefill_and_it_times_out() -> None:
    hold = {"pd_role": "prefill", "kv_hold_timeout_s": 40, **FAST}  # 2 s at speedup 20
    specs = [
        ("vllm", "p1", hold),
        ("vllm", "d1", {"pd_role": "decode", **FAST}),
        ("vllm", "d2", {"pd_role": "decode", **FAST}),
    ]
    with engines(*specs) as urls:
        with run_gateway(pd_cfg(urls, retry={"max_attempts": 2})) as gw:
            wait_until(lambda: all_reported(gw, 3), what="reports")
            for name in ("d1", "d2"):
                httpx.post(urls[name] + "/admin/disaggregation", json={"refuse_decodes": 1})
            r = ask(gw, LONG_PROMPT)
            assert r.status_code == 503, r.text
            assert "out of memory" in r.json()["error"]["message"]
            assert r.headers["x-kvroute-failed-step"] == "decode"
            assert r.headers["x-kvroute-failure-cause"] == "allocation_failure"
            # Both decode servers were given the one prefill (refused before any pull).
            assert r.headers["x-kvroute-attempts"] == "2"
            assert r.headers["x-kvroute-prefill-attempts"] == "1"
            assert server_state(urls["p1"])["kv_pulled"] == 0
            assert server_state(urls["p1"])["kv_holds"] == 1
            # Nobody pulls: the prefill server frees its blocks on its own timeout.
            wait_until(lambda: nothing_held(gw, urls), what="hold timed out")
            assert server_state(urls["p1"])["kv_expired"] == 1
            metrics = httpx.get(gw + "/metrics").text
            assert 'kvroute_two_step_total{result="refused",step="decode"} 1.0' in metrics
            assert 'kvroute_two_step_total{result="failed",step="decode"} 1.0' in metrics
            # The refusals are over: the next request runs both steps.
            r = ask(gw, long_prompt(1))
            assert r.status_code == 200 and r.headers["x-kvroute-prefill-backend"] == "p1"


@pytest.mark.parametrize("slow", ["prefill", "decode"])
def test_a_client_that_leaves_during_either_step_leaves_nothing_behind(slow: str) -> None:
    # The slow step takes seconds (at speedup 1); the client gives up within it.
    prefill = {"pd_role": "prefill", **FAST}
    decode = {"pd_role": "decode", **FAST}
    if slow == "prefill":
        prefill.update(speedup=1, prefill_tokens_per_s=100)
    else:
        decode.update(speedup=1, decode_tokens_per_s=2)
    with engines(("vllm", "p1", prefill), ("vllm", "d1", decode)) as urls:
        with run_gateway(pd_cfg(urls)) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            with pytest.raises(httpx.ReadTimeout):
                ask_body = {"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": 50}
                httpx.post(
                    gw + "/v1/completions", json=ask_body, timeout=httpx.Timeout(30, read=1.0)
                )
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")
            metrics = httpx.get(gw + "/metrics").text
            line = f'kvroute_two_step_total{{result="client_disconnect",step="{slow}"}} 1.0'
            assert line in metrics


def test_a_decode_step_that_fits_nowhere_holds_at_the_gateway_rather_than_preempt() -> None:
    # Two decode servers of 4096 tokens; each request's whole KV is ~3000 tokens: one each.
    decode = {"pd_role": "decode", "capacity_tokens": 4096, "speedup": 20, "block_size": 16}
    specs = [
        ("vllm", "p1", {"pd_role": "prefill", **FAST}),
        ("vllm", "d1", decode),
        ("vllm", "d2", decode),
    ]
    with engines(*specs) as urls:
        backends = pd_backends(urls)
        for b in backends:
            # A fast decode rate: without the hold, the gateway would hand the third request
            # to a decode server's queue at once (its expected wait is short), and it would
            # preempt there as the running request grows.
            b["decode_tokens_per_s"] = 10_000
        cfg = gateway_cfg(
            backends,
            disaggregation={"min_uncached_prompt_tokens": 64},
            queue={"max_wait_s": 60},
        )
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 3), what="reports")
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(ask, gw, long_prompt(i), 2_600) for i in range(3)]
                answers = [f.result() for f in futures]
            assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
            assert {a.headers["x-kvroute-backend"] for a in answers} == {"d1", "d2"}
            for name in ("d1", "d2"):
                assert sum(e["preemptions"] for e in server_state(urls[name])["engines"]) == 0
            # The third one was prefilled while it waited for a decode server.
            metrics = httpx.get(gw + "/metrics").text
            assert 'kvroute_two_step_total{result="while_holding",step="prefill"} 1.0' in metrics
            assert 'kvroute_two_step_total{result="ok",step="prefill"} 3.0' in metrics
            wait_until(lambda: nothing_held(gw, urls), what="nothing held")


def test_step_1s_one_token_answers_teach_neither_output_lengths_nor_characters() -> None:
    # Each two-step request's step 1 answers one token by design. As a lesson it said
    # "this class writes all of max_tokens" (1 of 1), and its 3 or 4 characters, averaged
    # with long streams, dragged the learned characters per token down: decode flights'
    # written tokens then read high, and a decode server took a document it preempted for.
    specs = [
        ("vllm", "p1", {"pd_role": "prefill", **FAST}),
        ("vllm", "d1", {"pd_role": "decode", **FAST}),
    ]
    with engines(*specs) as urls:
        with run_gateway(pd_cfg(urls, memory_pressure={"min_samples": 2})) as gw:
            wait_until(lambda: all_reported(gw, 2), what="reports")
            for i in range(3):
                # Non-streamed: the decode server's whole answer teaches (40 of 400).
                r = ask(gw, long_prompt(i) + marker(40), max_tokens=400)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-prefill-backend"] == "p1"
            learned = fleet_state(gw)["memory_pressure"]["learned_output"]
            # Three answers, three samples, the real ratio: not six, half of them 1.0.
            assert learned == {"model:sim-model|short": {"ratio": 40 / 400, "samples": 3}}, learned
