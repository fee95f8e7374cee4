"""The hash memo gives exactly the hashes of the pieces it is handed, from memory where it can.

Every answer is compared with ``pieces_hashes`` of the same pieces computed from nothing:
the memo may only save work, never change a hash. The pieces cache's bound counts a piece
shared by many texts once.
"""

from __future__ import annotations

import gc
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.chain_hash import Piece, piece_of, pieces_hashes, pieces_hashes_from
from proxy.core.hash_memo import HashMemo
from proxy.core.prefix_prompt import PiecesCache, prompt_hashes


def _piece(rng: random.Random, n: int) -> Piece:
    return piece_of([rng.randrange(100_000) for _ in range(n)])


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 90), min_size=1, max_size=8),
    split=st.integers(0, 8),
    block=st.integers(1, 20),
    cap=st.integers(0, 400),
)
def test_continuing_from_a_prefix_gives_the_whole_prompts_hashes(
    sizes: list[int], split: int, block: int, cap: int
) -> None:
    rng = random.Random(sum(sizes) + split)
    pieces = [_piece(rng, n) for n in sizes]
    k = min(split, len(pieces))
    head, at = pieces_hashes_from(pieces[:k], block, cap)
    rest, _ = pieces_hashes_from(pieces[k:], block, cap, at)
    assert head + rest == pieces_hashes(pieces, block, cap)


def test_the_same_pieces_again_are_found_whole_and_equal() -> None:
    rng = random.Random(1)
    pieces = [_piece(rng, 5), _piece(rng, 3000)]
    memo = HashMemo(min_hashes=1)
    first = memo.hashes(pieces, 16, 0)
    again = memo.hashes(list(pieces), 16, 0)
    assert again is first  # the held tuple, not computed again
    assert list(first) == pieces_hashes(pieces, 16)
    assert (memo.whole, memo.missed) == (1, 1)


def test_a_chats_next_turn_hashes_only_its_new_pieces() -> None:
    rng = random.Random(2)
    turn = [_piece(rng, n) for n in (3, 700, 2, 45)]
    memo = HashMemo(min_hashes=1)
    memo.hashes(turn, 16, 0)
    following = [*turn, _piece(rng, 2), _piece(rng, 333), _piece(rng, 2), _piece(rng, 17)]
    got = memo.hashes(following, 16, 0)
    assert list(got) == pieces_hashes(following, 16)
    assert memo.prefix == 1


def test_a_prefix_past_the_cap_is_the_whole_answer() -> None:
    rng = random.Random(3)
    doc = [_piece(rng, 400)]
    memo = HashMemo(min_hashes=1)
    memo.hashes(doc, 16, 160)
    longer = [*doc, _piece(rng, 50)]
    assert list(memo.hashes(longer, 16, 160)) == pieces_hashes(longer, 16, 160)
    assert len(memo.hashes(longer, 16, 160)) == 10


def test_other_block_sizes_and_caps_are_other_entries() -> None:
    rng = random.Random(4)
    pieces = [_piece(rng, 500)]
    memo = HashMemo(min_hashes=1)
    for block, cap in ((16, 0), (8, 0), (16, 100)):
        assert list(memo.hashes(pieces, block, cap)) == pieces_hashes(pieces, block, cap)
    assert len(memo) == 3


def test_an_entry_is_used_only_while_its_pieces_are_the_very_objects_handed_in() -> None:
    # An identity is reused once its object is gone. Stand that up directly: the entry made
    # for a piece that then died is filed under the identity of a live, different piece.
    rng = random.Random(5)
    memo = HashMemo(min_hashes=1)
    dead, live = _piece(rng, 320), _piece(rng, 320)
    memo.hashes([dead], 16, 0)
    ((_key, entry),) = memo._lru.items()
    memo._lru.clear()
    memo._lru[(16, 0, (id(live),))] = entry
    del dead
    gc.collect()
    assert entry.refs[0]() is None  # the memo kept no piece alive
    assert list(memo.hashes([live], 16, 0)) == pieces_hashes([live], 16)
    assert (memo.whole, memo.missed) == (0, 2)
    assert memo.held_hashes == 20  # the stale entry's hashes left the count


def test_the_memo_is_bounded_by_hashes_held_least_recent_first() -> None:
    rng = random.Random(6)
    memo = HashMemo(max_hashes=500, min_hashes=1)
    prompts = [[_piece(rng, 16 * 200)] for _ in range(3)]
    for p in prompts:
        memo.hashes(p, 16, 0)
    assert memo.held_hashes <= 500
    assert len(memo) == 2
    memo.hashes(prompts[0], 16, 0)  # evicted: computed again
    assert memo.missed == 4


def test_short_prompts_are_not_kept() -> None:
    memo = HashMemo(min_hashes=64)
    memo.hashes([piece_of(list(range(100)))], 16, 0)
    assert len(memo) == 0


def test_texts_sharing_a_piece_count_it_once_in_the_pieces_cache() -> None:
    rng = random.Random(7)
    tail = _piece(rng, 5000)
    heads = {f"question {i} " * 30: _piece(rng, 10) for i in range(64)}

    def encode(text: str) -> list[Piece]:
        return [heads[text], tail]

    cache = PiecesCache(max_tokens=20_000, min_chars=10)
    for text in heads:
        cache.tokens("t", encode, text)
    assert cache.held_tokens == 5000 + 64 * 10
    for text in heads:  # all 64 still held: no encode on the second pass
        assert cache.tokens("t", lambda _: [], text)[1] == 5010


def test_a_prompt_resent_through_the_pieces_cache_finds_its_hashes() -> None:
    doc = " ".join(f"w{i}" for i in range(3000))

    def encode(text: str) -> list[Piece]:
        return [piece_of([len(w) for w in text.split()])]

    cache = PiecesCache(min_chars=100)
    body = {"messages": [{"role": "user", "content": doc}]}
    first = prompt_hashes(body, "t", encode, 100_000, 16, cache)
    second = prompt_hashes(body, "t", encode, 100_000, 16, cache)
    assert second is first
    assert first == prompt_hashes(body, "t", encode, 100_000, 16)


def test_a_chats_next_turn_through_the_pieces_cache_continues_the_last_prompt() -> None:
    def encode(text: str) -> list[Piece]:
        return [piece_of([len(w) for w in text.split()])]

    history = " ".join(f"h{i}" for i in range(2000))
    turn = [{"role": "system", "content": history}, {"role": "user", "content": "q1 " * 100}]
    follow = [
        *turn,
        {"role": "assistant", "content": "a1 " * 90},
        {"role": "user", "content": "q2"},
    ]
    cache = PiecesCache(min_chars=100)
    prompt_hashes({"messages": turn}, "t", encode, 100_000, 16, cache)
    got = prompt_hashes({"messages": follow}, "t", encode, 100_000, 16, cache)
    assert got == prompt_hashes({"messages": follow}, "t", encode, 100_000, 16)
    assert (cache.hashes.prefix, cache.hashes.missed) == (1, 1)


def test_texts_made_only_of_held_pieces_are_bounded_in_number() -> None:
    # The same chunks in another order add an entry and no tokens: the count bounds them.
    shared = [piece_of(list(range(i, i + 50))) for i in range(4)]
    cache = PiecesCache(max_tokens=1_000, min_chars=10, max_entries=8)
    for i in range(40):
        order = shared[i % 4 :] + shared[: i % 4]

        def encode(_: str, o: list[Piece] = order) -> list[Piece]:
            return list(o)

        cache.tokens("t", encode, f"text {i} " * 5)
    assert len(cache._lru) == 8
    assert cache.held_tokens == 200
