"""The model checks itself, through the real gateway against a vLLM-mode engine (issue 53).

The gateway is told the engine prefills a million tokens a second; it really prefills 600.
Its predictions miss every stream's first token by about a second, and after enough of them
the ranking runs blind (``kvroute_ranking_blind``, ``/fleet``'s ``ttft_model``). Streams
whose first token comes at once then agree with the model again, and it is trusted again.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx

from proxy.routing.prediction_check import CheckSettings
from tests.support.behaviours import engines
from tests.support.gateway import all_reported, gateway_cfg, run_gateway, wait_until

SETTINGS = CheckSettings()


def stream(gw: str, prompt: str, max_tokens: int) -> int:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", gw + "/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            pass
        return r.status_code


def ttft_model(gw: str) -> dict[str, Any]:
    shown: dict[str, Any] = httpx.get(gw + "/fleet", timeout=10).json()["ttft_model"]
    return shown


def blind_gauge(gw: str) -> float:
    for line in httpx.get(gw + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvroute_ranking_blind "):
            return float(line.split()[1])
    raise AssertionError("kvroute_ranking_blind is not exported")


def test_predictions_that_miss_turn_the_ranking_blind_and_good_ones_turn_it_back() -> None:
    flags = {
        "capacity_tokens": 200_000,
        "block_size": 16,
        "prefill_tokens_per_s": 600,
        "model": "m",
    }
    with engines(("vllm", "v", flags)) as urls:
        wrong = [{"name": "v", "url": urls["v"], "kind": "vllm", "prefill_tokens_per_s": 1e6}]
        cfg = gateway_cfg(wrong, collector={"stale_after_s": 60.0})
        with run_gateway(cfg) as gw:
            wait_until(lambda: all_reported(gw, 1), what="report")
            assert ttft_model(gw)["ranking"] == "model" and blind_gauge(gw) == 0.0
            # ~900 prompt tokens at 600 tokens/s: about 1.5 s to the first token, predicted ~0.
            # Each prompt its own (the engine's prefix cache would skip a repeated one).
            n = SETTINGS.min_samples + 4
            prompts = [f"{i} " + "alpha beta gamma " * 300 for i in range(n)]
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                statuses = list(pool.map(lambda p: stream(gw, p, 2), prompts))
            assert statuses == [200] * n
            shown = ttft_model(gw)
            record = shown["backends"]["v"]
            assert record["checked"] == n and record["misses"] >= SETTINGS.min_samples, record
            assert record["mean_error_s"] > SETTINGS.floor_s, record
            assert shown["ranking"] == "blind" and shown["fallbacks"] == 1, shown
            assert blind_gauge(gw) == 1.0
            # /fleet says where the rates behind the prediction come from.
            rates = httpx.get(gw + "/fleet", timeout=10).json()["rates"]["v"]
            assert rates["prefill_tokens_per_s"] == 1e6, rates
            assert rates["prefill_source"] == "configured", rates
            # Two-token streams show no decode rate: the default stands, and says so.
            assert (rates["decode_source"], rates["decode_tokens_per_s"]) == ("default", 30.0)
            # First tokens at once: the predictions hold again, and the model is trusted again
            # once the misses are a small enough share of the window.
            for _ in range(SETTINGS.window):
                assert stream(gw, "hi", 1) == 200
                if ttft_model(gw)["ranking"] == "model":
                    break
            shown = ttft_model(gw)
            assert shown["ranking"] == "model" and blind_gauge(gw) == 0.0, shown
            assert shown["recent_miss_share"] <= SETTINGS.return_below
            metrics = httpx.get(gw + "/metrics", timeout=10).text
            assert 'kvroute_ttft_observed_seconds_count{backend="v"}' in metrics
            assert 'kvroute_ttft_prediction_misses_total{backend="v"}' in metrics
