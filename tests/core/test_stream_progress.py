"""Tokens a relayed stream carried, from its bytes (proxy.core.stream_progress)."""

from __future__ import annotations

from proxy.core.stream_progress import DEFAULT_CHARS_PER_TOKEN, CharsPerToken, StreamCount


def event(text: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (
        b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"'
        + text.encode()
        + b'"},"finish_reason":'
        + reason.encode()
        + b"}]}\n\n"
    )


def test_several_tokens_in_one_event_count_by_their_characters() -> None:
    count = StreamCount()
    count.add(event(" one two three four five six seven eight"))  # 40 chars, one event
    assert count.events == 1 and count.chars == 40
    assert count.tokens(4.0, 100) == 10
    assert count.tokens(8.0, 100) == 5


def test_one_token_per_event_counts_by_events() -> None:
    count = StreamCount()
    count.add(event(" a") + event(" b") + event(" c") + b"data: [DONE]\n\n")
    assert count.events == 3 and count.tokens(DEFAULT_CHARS_PER_TOKEN, 100) == 3


def test_a_stream_at_max_tokens_is_exact_and_teaches_characters_per_token() -> None:
    count = StreamCount()
    count.add(event(" abcdef" * 10, finish="length"))
    assert count.tokens(4.0, 10) == 10
    learned = CharsPerToken(weight=0.5, horizon_tokens=10)
    assert learned.get("m") == DEFAULT_CHARS_PER_TOKEN
    learned.observe("m", count.chars, 10)
    assert learned.get("m") == 7.0
    # Ten more tokens halve what the first ten weigh: (35 + 30) / (5 + 10).
    learned.observe("m", 30, 10)
    assert abs(learned.get("m") - 65 / 15) < 1e-9
    learned.observe("m", 0, 10)  # nothing written: nothing learned
    assert abs(learned.get("m") - 65 / 15) < 1e-9


def test_one_token_answers_barely_move_what_long_streams_taught() -> None:
    # A two-step request's prefill step answers one token (" of": 3 characters): dozens of
    # them must not drag down a ratio 1,500-token streams taught, or written tokens read high.
    learned = CharsPerToken()
    for _ in range(4):
        learned.observe("m", 6_405, 1_500)  # 4.27 characters per token
    for _ in range(40):
        learned.observe("m", 3, 1)
    assert learned.get("m") > 4.2
    # Streams still move it: a shift in what the model writes is followed.
    for _ in range(10):
        learned.observe("m", 3_000, 1_000)
    assert learned.get("m") < 3.3


def test_escaped_quotes_stay_inside_the_text_and_completions_count_too() -> None:
    count = StreamCount()
    count.add(b'data: {"choices":[{"text":"say \\"hi\\" now","finish_reason":null}]}\n\n')
    assert count.chars == len('say \\"hi\\" now')
