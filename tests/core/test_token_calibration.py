"""The pure learning behind honest token counts (``proxy.core.token_calibration``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import parse_config
from proxy.config.tokenizer_check import is_openai_model, tokenizer_warnings
from proxy.core.token_calibration import TokenCalibration, prompt_tokens_in


def test_a_steady_ratio_is_learned_said_once_and_corrects_counts() -> None:
    cal = TokenCalibration()
    said = [cal.observe("llama", 1000, 1300) for _ in range(10)]
    # Not before min_samples answers, then exactly once.
    assert said[:4] == [None] * 4 and said[4] is not None and said[5:] == [None] * 5
    assert said[4].ratio == pytest.approx(1.3) and said[4].corrected
    assert cal.correct("llama", 10_000) == 13_000
    assert cal.view()["llama"]["corrected"] is True


def test_within_tolerance_nothing_changes() -> None:
    cal = TokenCalibration()
    assert all(cal.observe("gpt-4o", 1000, 1020) is None for _ in range(20))
    assert cal.ratio("gpt-4o") is None and cal.correct("gpt-4o", 500) == 500


def test_a_configured_tokenizer_is_shown_but_never_corrected() -> None:
    cal = TokenCalibration(configured=frozenset({"llama"}))
    said = [cal.observe("llama", 1000, 1300) for _ in range(5)]
    assert said[-1] is not None and not said[-1].corrected
    assert cal.correct("llama", 1000) == 1000
    assert cal.view()["llama"] == {
        "server_to_gateway_ratio": 1.3,
        "samples": 5,
        "mismatched": True,
        "corrected": False,
        "tokenizer_configured": True,
    }


def test_tiny_and_implausible_samples_are_ignored() -> None:
    cal = TokenCalibration(min_samples=1)
    assert cal.observe("m", 5, 20) is None  # template overhead, not the tokenizer
    assert cal.observe("m", 1000, 9000) is None  # an image or a bug, not a tokenizer
    assert cal.view() == {}


def test_token_weighting_lets_long_prompts_decide() -> None:
    cal = TokenCalibration(min_samples=2)
    cal.observe("m", 20, 30)  # a short chat: 1.5 from a few template tokens
    cal.observe("m", 10_000, 11_000)
    assert cal.ratio("m") == pytest.approx(11_030 / 10_020, rel=1e-3)


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (b'{"id":"x","usage":{"prompt_tokens":130,"completion_tokens":5}}', 130),
        (b'{"usage": {"prompt_tokens" : 7}}', 7),
        (b'data: {"choices":[],"usage":{"prompt_tokens":42}}\n\ndata: [DONE]\n\n', 42),
        # Generated text that quotes the key has its quotes escaped: not usage.
        (b'{"choices":[{"text":"say \\"prompt_tokens\\": 9"}]}', None),
        (b'{"choices":[]}', None),
        (b'{"usage":{"prompt_tokens":null}}', None),
    ],
)
def test_prompt_tokens_are_read_from_answer_bytes(data: bytes, want: int | None) -> None:
    assert prompt_tokens_in(data) == want


def test_check_config_names_vllm_models_without_a_tokenizer() -> None:
    backends = [
        {
            "name": "a",
            "url": "http://127.0.0.1:1",
            "kind": "vllm",
            "models": ["meta-llama/Llama-3.1-8B", "gpt-4o"],
        },
        {"name": "b", "url": "http://127.0.0.1:2", "kind": "sglang", "models": ["qwen"]},
        {"name": "c", "url": "http://127.0.0.1:3", "kind": "tgi", "models": ["mistral"]},
        {"name": "d", "url": "http://127.0.0.1:4", "kind": "llamacpp", "models": ["smollm2"]},
    ]
    cfg = parse_config(
        {"backends": backends, "models": {"qwen": {"tokenizer": "o200k_base"}}}, "t", environ={}
    )
    warnings = tokenizer_warnings(cfg)
    assert len(warnings) == 2 and "'meta-llama/Llama-3.1-8B' (backend a)" in warnings[0]
    assert "models.meta-llama/Llama-3.1-8B.tokenizer_file" in warnings[0]
    assert "'smollm2' (backend d)" in warnings[1] and "its .gguf file" in warnings[1]
    assert is_openai_model("openai/gpt-4o-mini") and not is_openai_model("llama-3")


def test_check_config_prints_the_warning_and_still_passes(tmp_path: Path) -> None:
    cfg = tmp_path / "k.yaml"
    cfg.write_text(
        "backends: [{name: a, url: 'http://127.0.0.1:9', kind: vllm, models: [llama-3]}]\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "warning: model 'llama-3' (backend a) has no tokenizer configured" in res.stderr
    assert ": OK: 1 backend" in res.stdout
