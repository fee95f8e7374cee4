"""proxy.core.answer_usage: the output a whole JSON answer reports."""

from __future__ import annotations

import orjson

from proxy.core.answer_usage import AnswerUsage, answer_usage
from proxy.upstream.classify import json_object


def body(choices: list[dict[str, object]], usage: object) -> dict[str, object]:
    # As the gateway hands it on: the answer's bytes parsed once (``json_object``).
    parsed = json_object(
        orjson.dumps({"object": "chat.completion", "choices": choices, "usage": usage})
    )
    assert parsed is not None
    return parsed


def test_a_chat_answer_gives_its_count_its_end_and_its_text() -> None:
    choice = {"message": {"role": "assistant", "content": "héllo"}, "finish_reason": "stop"}
    got = answer_usage(body([choice], {"prompt_tokens": 9, "completion_tokens": 3}))
    # Text counted in UTF-8 bytes, as streams are.
    assert got == AnswerUsage(completion_tokens=3, at_length=False, chars=6)


def test_an_answer_cut_at_max_tokens_says_so() -> None:
    choice = {"text": "abcd", "finish_reason": "length"}
    got = answer_usage(body([choice], {"completion_tokens": 16}))
    assert got == AnswerUsage(16, True, 4)


def test_several_choices_count_per_choice() -> None:
    # max_tokens bounds each choice; usage counts them all.
    choices = [{"text": "ab", "finish_reason": "stop"}, {"text": "abcd", "finish_reason": "length"}]
    assert answer_usage(body(choices, {"completion_tokens": 30})) == AnswerUsage(15, True, 3)


def test_answers_without_a_usable_count_teach_nothing() -> None:
    choice = {"text": "x", "finish_reason": "stop"}
    assert answer_usage(body([choice], None)) is None
    assert answer_usage(body([choice], {"prompt_tokens": 4})) is None
    assert answer_usage(body([choice], {"completion_tokens": "7"})) is None
    assert answer_usage(body([choice], {"completion_tokens": -1})) is None
    assert answer_usage(body([choice], {"completion_tokens": True})) is None
    assert json_object(b"[1, 2]") is None
    assert json_object(b"{not json") is None
    assert json_object(b'"text"') is None
