"""The demand bounds hold: lower <= exact <= upper, over random texts, for tiktoken and HF.

``proxy.core.size_bounds`` lets the gateway route a big new prompt before its exact count is
in. That is only sound if the bounds are bounds: these property tests compare them with the
exact count (the same sizer, the chunk cache behind it) for whole requests and single texts.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.demand import ModelSizing, Sizer
from proxy.core.size_bounds import demand_bounds, piece_floor
from proxy.core.tokenizer import HFCounter, TiktokenCounter
from proxy.core.validation import parse_request
from tests.core.test_chunk_count import fresh, hf_gpt2, hf_llama3, texts

__all__ = ["hf_gpt2", "hf_llama3"]  # the fixtures, imported for pytest

CL = TiktokenCounter()
ODD = st.text(max_size=400)  # any unicode: short texts, spaces, letters next to non-letters


def sizer(counter: object) -> Sizer:
    _cache, wrapped = fresh(counter)
    return Sizer(ModelSizing(wrapped, default_max_tokens=64))


def chat(*contents: str, max_tokens: int | None = 32) -> bytes:
    body: dict[str, object] = {
        "model": "m",
        "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": c}
            for i, c in enumerate(contents)
        ],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return orjson.dumps(body)


def check(s: Sizer, raw: bytes, max_model_len: int | None = None) -> None:
    parsed = parse_request(raw, "chat", 10**9)
    exact = s.size(parsed, max_model_len)
    bounds = demand_bounds(s, parsed, max_model_len)
    assert bounds is not None
    assert bounds.lower.prompt_tokens <= exact.prompt_tokens <= bounds.upper.prompt_tokens
    assert bounds.lower.total <= exact.total <= bounds.upper.total


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), head=ODD, tail=ODD)
def test_tiktoken_bounds_hold_for_whole_requests(text: str, head: str, tail: str) -> None:
    check(sizer(CL), chat(head + text, tail))
    check(sizer(CL), chat(head, text), max_model_len=200_000)


@settings(max_examples=300, deadline=None)
@given(text=ODD)
def test_each_text_is_bounded_by_its_pieces_and_its_bytes(text: str) -> None:
    exact = CL.count(text)
    assert piece_floor(text) <= exact <= len(text.encode("utf-8", "surrogatepass"))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), head=ODD)
def test_hf_byte_level_bounds_hold(
    hf_gpt2: HFCounter, hf_llama3: HFCounter, text: str, head: str
) -> None:
    for hf in (hf_gpt2, hf_llama3):
        check(sizer(hf), chat(head, head + text))
        assert piece_floor(head) <= hf.count(head)


def test_prose_bounds_are_tight_enough_to_decide_the_class() -> None:
    # Prose: about one token per word, so the floor is most of the exact count.
    from loadtest.bench.big_prompts_load import document

    s = sizer(CL)
    parsed = parse_request(chat(document(7, 60_000)), "chat", 10**9)
    exact = s.size(parsed).prompt_tokens
    bounds = demand_bounds(s, parsed)
    assert bounds is not None
    assert 0.6 * exact <= bounds.lower.prompt_tokens <= exact <= bounds.upper.prompt_tokens


def test_no_bounds_for_a_tokenizer_they_are_not_proven_for() -> None:
    plain = Sizer(ModelSizing(CL))  # not behind the chunk cache: not known to be cut-safe
    assert demand_bounds(plain, parse_request(chat("hello"), "chat", 10**9)) is None


@pytest.mark.parametrize("text", ["", "a", "ab", "a b", "a  b", "a b c", "é b", "1 2", "x\tb"])
def test_the_floor_counts_spaces_between_ascii_letters(text: str) -> None:
    want = {"": 0, "a b": 2, "a b c": 3}.get(text, 1)
    assert piece_floor(text) == want
