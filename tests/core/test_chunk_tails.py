"""A known document behind new heads: two pieces (first chunk, joined tail), exact every time."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.chunk_cuts import DEFAULT_RULE, DENSE, CutRule, cut_points
from proxy.core.chunk_tails import FIRST_CUT_WITHIN
from tests.core.test_chunk_count import CL, ENC, fresh, same_ids, texts, words_text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), rule=st.sampled_from([DEFAULT_RULE, DENSE, CutRule(2, 2, 300)]))
def test_the_first_cut_of_the_window_is_the_first_cut_of_the_text(text: str, rule: CutRule) -> None:
    data = text.encode("utf-8", "surrogatepass")
    window = cut_points(data[:FIRST_CUT_WITHIN], rule)
    whole = cut_points(data, rule)
    if window:
        assert whole and whole[0] == window[0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=texts(), heads=st.lists(st.text(max_size=400), min_size=2, max_size=4))
def test_a_document_behind_any_head_gives_the_ids_of_a_full_encode(
    doc: str, heads: list[str]
) -> None:
    _cache, counter = fresh(CL, DEFAULT_RULE)
    for head in [*heads, *heads]:
        text = head + "\n" + doc
        full = ENC.encode(text, disallowed_special=())
        assert same_ids(counter.pieces(text), full)
        assert counter.count(text) == len(full)


def test_the_tail_is_kept_once_it_comes_behind_a_second_head() -> None:
    cache, counter = fresh(CL, DEFAULT_RULE)
    doc = words_text(3, 120_000)
    first = counter.pieces("Question 0: what?\n" + doc)
    counter.pieces("Question 0: what?\n" + doc)  # the same body again: nothing to join
    assert len(first) > 10 and len(cache.tails) == 0
    counter.pieces("Question 1: and then?\n" + doc)
    assert len(cache.tails) == 1
    hits = cache.hits
    for i in range(2, 7):
        text = f"Question {i}: and section {i}?\n" + doc
        got = counter.pieces(text)
        assert len(got) == 2  # the new first chunk, then the tail joined
        assert same_ids(got, ENC.encode(text, disallowed_special=()))
    assert len(cache.tails) == 1
    assert cache.hits - hits >= 5 * (len(first) - 1)  # the tail's chunks count as hits


def test_tails_are_bounded_by_a_quarter_of_the_cache() -> None:
    cache, counter = fresh(CL, DEFAULT_RULE)
    cache.tails.bound(600_000)
    rng = random.Random(1)
    for i in range(8):
        doc = words_text(rng.randrange(10**6), 60_000)
        counter.pieces(f"head {i}\n" + doc)
        counter.pieces(f"another head {i}\n" + doc)
    assert 0 < cache.tails.held_bytes <= 600_000
    assert len(cache.tails) < 8
