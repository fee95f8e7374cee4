"""max_model_len checks in vLLM's words, and the 404 for an unknown model."""

from __future__ import annotations

from proxy.core.model_limits import context_length_error, fleet_max_model_len, model_not_found


def test_within_the_limit_or_unknown_limit_passes() -> None:
    assert context_length_error(4_096, 3_000, 1_096, True) is None
    assert context_length_error(None, 10**6, 10**6, True) is None


def test_prompt_too_long() -> None:
    err = context_length_error(4_096, 5_000, 16, False)
    assert err is not None and err.status == 400
    assert "maximum context length is 4096 tokens" in err.message
    assert "your request has 5000 input tokens" in err.message
    assert err.body()["error"]["code"] == "context_length_exceeded"  # type: ignore[index]


def test_max_tokens_too_large() -> None:
    err = context_length_error(4_096, 2_778, 8_000, True)
    assert err is not None and err.param == "max_tokens"
    assert "(8000 > 4096 - 2778)" in err.message


def test_unknown_model_lists_what_is_served() -> None:
    err = model_not_found("gpt-5", ["llama-8b", "qwen-32b", "llama-8b"])
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "llama-8b, qwen-32b" in err.message


def test_fleet_limit_is_the_largest_known() -> None:
    assert fleet_max_model_len([None, 8_192, 32_768]) == 32_768
    assert fleet_max_model_len([None]) is None
