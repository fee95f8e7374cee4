"""Honest token counts through the real gateway: a vLLM-mode engine whose tokenizer counts
1.3x the gateway's (``--tokenizer-ratio 1.3``, as a Llama model behind a cl100k count).

The gateway learns the ratio from ``usage.prompt_tokens`` (whole answers and a stream's final
usage chunk), warns once, shows it in ``/fleet`` and ``/metrics``, and sizes later requests
(the 400 "has N input tokens" included) with the corrected count.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from proxy.gateway.sizing import count_prompt
from tests.support.behaviours import engines
from tests.support.gateway import gateway_cfg, run_gateway, wait_until

MODEL = "llama-sim"
FLAGS = {"model": MODEL, "speedup": 20, "max_model_len": 3000, "tokenizer_ratio": 1.3}


def counts(gw: str) -> dict[str, object]:
    view: dict[str, object] = httpx.get(gw + "/fleet", timeout=10).json()["token_counts"]
    return view


def test_a_backend_counting_more_tokens_is_learned_warned_and_corrected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvroute.tokens")
    with engines(("vllm", "v", FLAGS)) as urls:
        backends = [{"name": "v", "url": urls["v"], "kind": "vllm", "models": [MODEL]}]
        with run_gateway(gateway_cfg(backends)) as gw:
            body = {"model": MODEL, "prompt": "the quick brown fox " * 50, "max_tokens": 4}
            ours = count_prompt(body)
            for _ in range(3):
                r = httpx.post(gw + "/v1/completions", json=body, timeout=30)
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == round(
                    1.3 * ours
                )
            # Streamed answers teach it too, through their final usage chunk.
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            for _ in range(3):
                with httpx.stream("POST", gw + "/v1/completions", json=streamed, timeout=30) as s:
                    assert s.status_code == 200 and '"prompt_tokens"' in s.read().decode()
            wait_until(lambda: counts(gw).get(MODEL, {}).get("samples") == 6, what="6 samples")  # type: ignore[union-attr]
            seen = counts(gw)[MODEL]
            assert seen == {
                "server_to_gateway_ratio": pytest.approx(1.3, abs=0.01),
                "samples": 6,
                "mismatched": True,
                "corrected": True,
                "tokenizer_configured": False,
            }
            metrics = httpx.get(gw + "/metrics", timeout=10).text
            ratio = re.search(
                rf'kvroute_tokenizer_count_ratio{{model="{MODEL}"}} ([\d.]+)', metrics
            )
            assert ratio is not None and float(ratio.group(1)) == pytest.approx(1.3, abs=0.01)
            assert f'kvroute_tokenizer_correction_active{{model="{MODEL}"}} 1.0' in metrics
            # Sized as the server counts it: 2,400 gateway tokens are ~3,120 there, over the
            # 3,000 limit; the gateway's own 400 says so, and the engine never sees it.
            big = {"model": MODEL, "prompt": "word " * 2400, "max_tokens": 10}
            raw = count_prompt(big)
            assert raw + 10 <= 3000
            r = httpx.post(gw + "/v1/completions", json=big, timeout=30)
            assert r.status_code == 400, r.text
            said = re.search(r"has (\d+) input tokens", r.json()["error"]["message"])
            assert said is not None and 1.28 * raw <= int(said.group(1)) <= 1.32 * raw
    warnings = [rec for rec in caplog.records if rec.name == "kvroute.tokens"]
    assert len(warnings) == 1, [w.getMessage() for w in warnings]
    assert f"model {MODEL}: the servers count 30% more prompt tokens" in warnings[0].getMessage()


def test_a_configured_tokenizer_is_not_corrected() -> None:
    with engines(("vllm", "v", FLAGS)) as urls:
        backends = [{"name": "v", "url": urls["v"], "kind": "vllm", "models": [MODEL]}]
        cfg = gateway_cfg(backends, models={MODEL: {"tokenizer": "cl100k_base"}})
        with run_gateway(cfg) as gw:
            body = {"model": MODEL, "prompt": "the quick brown fox " * 50, "max_tokens": 4}
            for _ in range(5):
                assert httpx.post(gw + "/v1/completions", json=body, timeout=30).status_code == 200
            wait_until(lambda: MODEL in counts(gw), what="samples")
            seen = counts(gw)[MODEL]
            assert seen["mismatched"] is True and seen["corrected"] is False  # type: ignore[index]
            assert seen["tokenizer_configured"] is True  # type: ignore[index]
