"""kvroute's block hashes against their definition, and built from pieces as from ids.

The reference below is the definition in ``proxy.core.chain_hash``'s docstring written as
plain Python integers, one token at a time: the vectorized code (segments, inverse powers,
pieces joined at any offset) must give the same values.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import chain_hash
from proxy.core.chain_hash import block_hashes, joined, piece_of, pieces_hashes
from proxy.core.prefix_chain import ROOT, extend

MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    x = (x + int(chain_hash._SEED)) & MASK
    x ^= x >> 30
    x = (x * int(chain_hash._M1)) & MASK
    x ^= x >> 27
    x = (x * int(chain_hash._M2)) & MASK
    return x ^ (x >> 31)


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = (h * int(chain_hash._F1)) & MASK
    h ^= h >> 33
    h = (h * int(chain_hash._F2)) & MASK
    return h ^ (h >> 33)


def reference(ids: list[int], block: int) -> list[int]:
    out, r = [], 0
    for k, t in enumerate(ids, start=1):
        r = (r * chain_hash._B + _mix(t)) & MASK
        if k % block == 0:
            out.append(_fmix((r + k * int(chain_hash._GOLDEN)) & MASK))
    return out


ids_st = st.lists(st.integers(0, 2**40), max_size=200)


@settings(max_examples=150, deadline=None)
@given(ids=ids_st, block=st.integers(1, 20))
def test_block_hashes_follow_the_definition(ids: list[int], block: int) -> None:
    assert block_hashes(ids, block) == reference(ids, block)


def test_long_prompts_cross_segments_exactly() -> None:
    # Pieces are built in segments of 8,192 ids with a carry between them.
    rng = random.Random(7)
    ids = [rng.randrange(200_000) for _ in range(3 * 8192 + 37)]
    assert block_hashes(ids, 16) == reference(ids, 16)


def _split(ids: list[int], cuts: list[int]) -> list[np.ndarray]:
    bounds = [0, *sorted({c % (len(ids) + 1) for c in cuts}), len(ids)]
    return [piece_of(ids[a:b]) for a, b in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None)
@given(
    ids=ids_st,
    cuts=st.lists(st.integers(0, 400), max_size=8),
    block=st.integers(1, 20),
    cap=st.integers(0, 250),
)
def test_pieces_anywhere_give_the_hashes_of_their_ids(
    ids: list[int], cuts: list[int], block: int, cap: int
) -> None:
    pieces = _split(ids, cuts)
    want = block_hashes(ids[:cap] if cap else ids, block)
    assert pieces_hashes(pieces, block, max_tokens=cap) == want
    assert joined(pieces).tolist() == piece_of(ids).tolist()


def test_a_piece_does_not_depend_on_what_comes_before_it() -> None:
    # The chunk cache keeps a document's pieces once and reuses them behind any head.
    doc = list(range(1000, 1500))
    heads = [[1], [1, 2, 3], list(range(17))]
    cached = piece_of(doc)
    for head in heads:
        assert pieces_hashes([piece_of(head), cached], 16) == block_hashes(head + doc, 16)


def test_extending_from_a_chain_state_matches_the_whole_prompt() -> None:
    ids = list(range(300))
    first, state = extend(ROOT, ids[:100], 16)
    rest, _ = extend(state, ids[100:], 16)
    assert first + rest == block_hashes(ids, 16)


@pytest.mark.parametrize("bad", [[-1, 2], [2**64], ["a"], [[1, 2]]])
def test_ids_that_are_not_token_ids_have_no_blocks(bad: list[object]) -> None:
    assert block_hashes(bad * 16, 1) == []  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        piece_of(bad)  # type: ignore[arg-type]
