"""The simulated model's end of sequence (loadtest.engine.behaviours.eos)."""

from __future__ import annotations

from loadtest.engine.behaviours.eos import marker, output_tokens


def chat(text: str) -> dict[str, object]:
    return {
        "messages": [{"role": "system", "content": "[eos:1]"}, {"role": "user", "content": text}]
    }


def test_the_marker_at_the_prompts_end_sets_the_output_within_max_tokens() -> None:
    assert output_tokens(chat("write a poem " + marker(30)), 100) == 30
    assert output_tokens(chat("write a poem " + marker(300)), 100) == 100
    assert output_tokens({"prompt": "x " * 5000 + marker(7)}, 100) == 7


def test_without_a_marker_in_the_last_message_the_model_writes_max_tokens() -> None:
    # The system message's marker is not the last message's: ignored.
    assert output_tokens(chat("no marker"), 64) == 64
    assert output_tokens({"prompt": ["token", "ids"]}, 64) == 64
    assert output_tokens({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 8) == 8
    assert output_tokens(chat(marker(0)), 10) == 1
