"""The prefix index's binary search gives what scanning every block gives, under any history.

``PrefixIndex.match`` looks up ~log2(n) blocks, trusting the index's invariant that a held,
fresh block has its whole prefix held and as fresh (``proxy.core.prefix``). These tests
drive random histories (records of prompts sharing prefixes, late placements shared by
other replicas with older times, bounds that evict, expiry) and compare every match with
the plain scan of the same blocks, which is what ``match`` computed before.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.prefix import (
    REFRESH_FRACTION,
    REFRESH_MAX_S,
    PrefixIndex,
    PrefixIndexConfig,
    block_hashes,
)

BS = 4


def scanned(idx: PrefixIndex, node: str, hashes: list[int], now: float, ttl: float) -> int:
    """Leading blocks held and fresh, one lookup per block (the reference)."""
    blocks = idx._nodes[node].blocks if node in idx._nodes else {}
    n = 0
    for h in hashes:
        seen = blocks.get(h)
        if seen is None or now - seen > ttl:
            break
        n += 1
    return n


def prompts(draw: st.DrawFn) -> list[list[int]]:
    """A few token sequences sharing prefixes of random lengths (a tree of prompts)."""
    base = draw(st.lists(st.integers(0, 3), min_size=BS, max_size=40 * BS))
    out = [base]
    for _ in range(draw(st.integers(1, 5))):
        parent = draw(st.sampled_from(out))
        keep = draw(st.integers(0, len(parent)))
        tail = draw(st.lists(st.integers(0, 3), min_size=0, max_size=20 * BS))
        out.append(parent[:keep] + tail)
    return out


Op = tuple[str, int, float, int]


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[list[int]], list[Op]]:
    seqs = prompts(draw)
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["record", "late", "observe", "expire"]),
                st.integers(0, len(seqs) - 1),
                st.floats(0.0, 30.0),
                st.integers(0, 60),
            ),
            max_size=30,
        )
    )
    return seqs, ops


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(8, 200))
def test_match_equals_a_scan_of_every_block(
    history: tuple[list[list[int]], list[Op]], bound: int
) -> None:
    seqs, ops = history
    ttl = 10.0
    idx = PrefixIndex(
        PrefixIndexConfig(BS, ttl_s=ttl, pressure_ttl_s=ttl, max_blocks_per_node=bound)
    )
    chains = [block_hashes(s, BS) for s in seqs]
    now = 0.0
    for kind, which, step, size in ops:
        now += step / 10
        if kind == "record":
            idx.record("a", chains[which], now)
        elif kind == "late":
            # Another replica's placement, arriving after newer ones of this replica.
            idx.record("a", chains[which], max(0.0, now - step))
        elif kind == "observe":
            idx.observe("a", capacity_tokens=size * BS, pressured=False)
        else:
            idx.expire(now)
        for chain in chains:
            assert idx.match("a", chain, now) == scanned(idx, "a", chain, now, ttl)
            recent = idx.match("a", chain, now, max_age_s=ttl / 2)
            assert recent == scanned(idx, "a", chain, now, ttl / 2)


def test_a_prompt_sent_again_matches_whole_and_a_new_head_matches_nothing() -> None:
    idx = PrefixIndex(PrefixIndexConfig(BS))
    doc = list(range(1000))
    chain = block_hashes(doc, BS)
    idx.record("a", chain, 1.0)
    assert idx.match("a", chain, 2.0) == len(chain)
    assert idx.match("a", block_hashes([7, *doc], BS), 2.0) == 0
    assert idx.match("a", block_hashes(doc[:400] + [1] * 600, BS), 2.0) == 400 // BS


def test_an_older_placement_never_makes_a_block_older() -> None:
    idx = PrefixIndex(PrefixIndexConfig(BS, ttl_s=10.0))
    chain = block_hashes(list(range(40)), BS)
    idx.record("a", chain, 100.0)
    idx.record("a", chain[:3], 50.0)  # shared late by another replica
    assert idx.match("a", chain, 109.0) == len(chain)


def test_a_prompt_recorded_again_soon_is_left_as_it_is_and_later_refreshed() -> None:
    ttl = 32.0  # refreshed once older than ttl * REFRESH_FRACTION = 1 s (< REFRESH_MAX_S)
    idx = PrefixIndex(PrefixIndexConfig(BS, ttl_s=ttl, pressure_ttl_s=ttl))
    chain = block_hashes(list(range(40)), BS)
    idx.record("a", chain, 100.0)
    idx.record("a", chain, 100.0 + ttl * REFRESH_FRACTION)  # within the window: skipped
    assert idx.match("a", chain, 100.0 + ttl) == len(chain)
    assert idx.match("a", chain, 100.1 + ttl) == 0  # expired by the first record's time
    idx.record("a", chain, 101.5)  # past the window: rewritten
    assert idx.match("a", chain, 101.5 + ttl) == len(chain)


def test_the_refresh_window_is_never_longer_than_refresh_max_s() -> None:
    idx = PrefixIndex(PrefixIndexConfig(BS, ttl_s=3600.0))  # 1/32 of it: 112 s
    chain = block_hashes(list(range(40)), BS)
    idx.record("a", chain, 0.0)
    idx.record("a", chain, REFRESH_MAX_S + 0.5)  # rewritten: past the cap
    assert idx.match("a", chain, 3600.0 + REFRESH_MAX_S) == len(chain)


def test_a_prompt_whose_tail_was_evicted_is_recorded_again_at_once() -> None:
    idx = PrefixIndex(PrefixIndexConfig(BS, max_blocks_per_node=8))
    chain = block_hashes(list(range(10 * BS)), BS)
    idx.record("a", chain, 1.0)
    assert idx.match("a", chain, 1.0) == 8
    idx.record("a", chain[:2] + block_hashes([5] * (6 * BS), BS)[2:], 1.5)
    idx.record("a", chain, 2.0)
    assert idx.match("a", chain, 2.0) == 8
