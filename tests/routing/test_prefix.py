"""The prefix index (chained block hashes, expiry, bounds) and the affinity rule of the kvroute policy."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.chain_hash import Piece, joined, piece_of
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.prefix import PrefixIndex, PrefixIndexConfig, block_hashes
from proxy.core.prefix_prompt import PiecesCache, prompt_pieces
from proxy.routing import KvroutePolicy, PolicySettings, RouteRequest
from proxy.routing.affinity import AffinitySettings, demand_on

BS = 16


# --- hashing -----------------------------------------------------------------------------


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(47)), BS)) == 2
    assert len(block_hashes(list(range(48)), BS)) == 3
    assert block_hashes(list(range(15)), BS) == []
    assert len(block_hashes(list(range(1000)), BS, max_blocks=5)) == 5


@given(st.lists(st.integers(0, 2**40), max_size=5 * BS), st.integers(0, 6))
def test_the_gateways_ids_array_hashes_as_any_sequence_of_the_same_ids(
    ids: list[int], max_blocks: int
) -> None:
    # The 64-bit array prompt_ids returns is hashed in place, without a copy: same hashes.
    assert block_hashes(array("q", ids), BS, max_blocks) == block_hashes(ids, BS, max_blocks)
    assert block_hashes(tuple(ids), BS, max_blocks) == block_hashes(ids, BS, max_blocks)


@given(
    st.lists(st.integers(0, 100_000), min_size=BS, max_size=6 * BS),
    st.integers(0, 6 * BS - 1),
)
def test_hashes_agree_exactly_up_to_the_block_holding_the_first_difference(
    ids: list[int], at: int
) -> None:
    at = at % len(ids)
    other = list(ids)
    other[at] += 1
    a, b = block_hashes(ids, BS), block_hashes(other, BS)
    first_changed = at // BS
    assert a[:first_changed] == b[:first_changed]
    # Chained: the changed block and every block after it differ.
    assert all(x != y for x, y in zip(a[first_changed:], b[first_changed:], strict=True))


def test_different_prefixes_hash_apart_and_equal_ones_alike_over_many_random_cases() -> None:
    # A false match would only misplace a preference, but it must be rare: none in ~10^5
    # pairs of prefixes that differ (many in one token, the hardest case for a sum).
    rng = random.Random(12)
    seen: dict[int, tuple[int, ...]] = {}
    for _ in range(3000):
        ids = [rng.randrange(100_000) for _ in range(rng.randrange(1, 9) * BS)]
        other = list(ids)
        other[rng.randrange(len(ids))] ^= 1 << rng.randrange(17)
        for seq in (ids, other):
            for i, h in enumerate(block_hashes(seq, BS)):
                prefix = tuple(seq[: (i + 1) * BS])
                assert seen.setdefault(h, prefix) == prefix
        # Same prefix, same hashes, whatever follows it.
        tail = [rng.randrange(100_000) for _ in range(rng.randrange(3 * BS))]
        assert block_hashes(ids + tail, BS)[: len(ids) // BS] == block_hashes(ids, BS)


@given(st.lists(st.integers(0, 2**31), max_size=8 * BS), st.integers(1, 40))
def test_a_hash_falls_exactly_at_each_multiple_of_the_block_size(
    ids: list[int], block: int
) -> None:
    got = block_hashes(ids, block)
    assert len(got) == len(ids) // block
    for i, h in enumerate(got):
        # Block i's hash is the hash of the prompt cut exactly at its end.
        assert block_hashes(ids[: (i + 1) * block], block)[-1] == h
        assert all(0 <= x < 2**64 for x in got)
    if len(ids) > block:
        # A change right after a boundary leaves that boundary's hash alone, not the next.
        changed = list(ids)
        changed[block] += 1
        again = block_hashes(changed, block)
        assert again[0] == got[0]
        assert again[1:] != got[1:] or len(got) == 1


def test_hashes_are_the_same_in_every_process() -> None:
    # Replicas share hashes through Redis: no per-process seed (hash randomization, a
    # random key) may enter them. Pinned values, and a fresh process with another seed.
    ids = list(range(3 * BS))
    pinned = [16142256744879136546, 13496794653809945037, 4420371235877836686]
    assert block_hashes(ids, BS) == pinned
    code = "from proxy.core.prefix import block_hashes; print(block_hashes(list(range(48)), 16))"
    env = os.environ | {"PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(pinned)


def test_what_is_not_token_ids_hashes_to_nothing() -> None:
    assert block_hashes(["a"] * 2 * BS, BS) == []
    assert block_hashes([2**70] * 2 * BS, BS) == []
    assert block_hashes([[1]] * 2 * BS, BS) == []


def test_a_block_hash_depends_on_its_parents_not_only_its_tokens() -> None:
    block = list(range(BS))
    a = block_hashes([1] * BS + block, BS)
    b = block_hashes([2] * BS + block, BS)
    assert a[1] != b[1]


def test_prompt_pieces_share_leading_messages_and_cache_repeated_texts() -> None:
    calls: list[str] = []

    def encode(text: str) -> list[Piece]:
        calls.append(text)
        return [piece_of([len(w) for w in text.split()])]

    doc = "alpha beta gamma " * 200
    first = {"messages": [{"role": "user", "content": doc + "question one"}]}
    chat = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "q1"}]}
    follow = {
        "messages": [
            {"role": "system", "content": doc},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
    }
    cache = PiecesCache(min_chars=100)
    a = joined(prompt_pieces(chat, "t", encode, 10_000, cache)[0])
    b = joined(prompt_pieces(follow, "t", encode, 10_000, cache)[0])
    assert b[: len(a)].tolist() == a.tolist()
    assert calls.count(doc) == 1  # the document was tokenized once
    pieces, held = prompt_pieces(first, "t", encode, 50, cache)
    assert held == len(joined(pieces)) >= 50  # stops once past
    assert (
        prompt_pieces({"prompt": [5, 6, 7]}, "t", encode, 2)[0][0].tolist()
        == piece_of([5, 6]).tolist()
    )


# --- the index ---------------------------------------------------------------------------


def index(**kw: float) -> PrefixIndex:
    return PrefixIndex(PrefixIndexConfig(block_tokens=BS, **kw))  # type: ignore[arg-type]


def test_match_counts_leading_blocks_and_stops_at_the_first_miss() -> None:
    idx = index()
    doc = block_hashes(list(range(10 * BS)), BS)
    idx.record("a", doc, now=0.0)
    assert idx.match("a", doc, now=1.0) == 10
    assert idx.match("b", doc, now=1.0) == 0
    longer = block_hashes(list(range(10 * BS)) + [7] * (3 * BS), BS)
    assert idx.match("a", longer, now=1.0) == 10
    other_start = block_hashes([9] * BS + list(range(BS, 10 * BS)), BS)
    assert idx.match("a", other_start, now=1.0) == 0


def test_entries_expire_by_age_and_sooner_under_pressure() -> None:
    idx = index(ttl_s=100.0, pressure_ttl_s=10.0)
    doc = block_hashes(list(range(4 * BS)), BS)
    idx.record("a", doc, now=0.0)
    idx.record("b", doc, now=0.0)
    assert idx.match("a", doc, now=50.0) == 4
    idx.observe("b", capacity_tokens=100_000, pressured=True)
    assert idx.match("b", doc, now=50.0) == 0  # an evicting node forgets after 10 s
    assert idx.match("a", doc, now=101.0) == 0  # and every node after 100 s
    assert idx.expire(now=101.0) == 8
    assert idx.size() == 0


def test_a_match_keeps_its_blocks_warm() -> None:
    idx = index(ttl_s=100.0)
    doc = block_hashes(list(range(4 * BS)), BS)
    idx.record("a", doc, now=0.0)
    idx.touch("a", doc, now=90.0)
    assert idx.match("a", doc, now=150.0) == 4


def test_memory_is_bounded_by_config_and_by_the_nodes_capacity_lru_first() -> None:
    idx = index(max_blocks_per_node=8)
    old = block_hashes(list(range(6 * BS)), BS)
    new = block_hashes([3] * (6 * BS), BS)
    idx.record("a", old, now=0.0)
    idx.record("a", new, now=1.0)
    assert idx.size("a") == 8
    assert idx.match("a", new, now=2.0) == 6
    # Its last blocks went first, as vLLM evicts a freed request's tail first: its head is left.
    assert idx.match("a", old, now=2.0) == 2
    idx.observe("a", capacity_tokens=4 * BS, pressured=False)
    assert idx.size("a") == 4


# --- the policy ---------------------------------------------------------------------------


def paged(name: str, free: int, cap: int = 200_000, **ov: object) -> NodeView:
    report = MemoryReport(
        capacity_tokens=cap,
        free_tokens=free,
        largest_free_block_tokens=free,
        allocator="paged",
        block_size=BS,
        queueing=True,
        reported_at=0.0,
    )
    return NodeView(name, report=report, overlay=Overlay(**ov))  # type: ignore[arg-type]


def contiguous(name: str, largest: int, free: int | None = None) -> NodeView:
    report = MemoryReport(
        capacity_tokens=200_000,
        free_tokens=free if free is not None else largest,
        largest_free_block_tokens=largest,
        reported_at=0.0,
    )
    return NodeView(name, report=report)


def rank(*nodes: NodeView, demand: int, cls: str = "long", **kw: object) -> list[str]:
    policy = KvroutePolicy(PolicySettings(long_threshold_tokens=8_000))
    req = RouteRequest(demand, cls, **kw)  # type: ignore[arg-type]
    return policy.rank(FleetSnapshot(tuple(nodes)), req, now=1.0)


def test_the_node_holding_the_document_wins_when_the_request_fits_there() -> None:
    # The queue order alone would pick b (a has 3 requests in flight, b none); a holds 24k
    # of the 25k prompt.
    a, b = paged("a", free=150_000, inflight=3), paged("b", free=40_000)
    assert rank(a, b, demand=25_300) == ["b", "a"]
    assert rank(a, b, demand=25_300, cached={"a": 24_000}) == ["a", "b"]


def test_fit_stays_hard_a_cached_node_where_it_does_not_fit_is_not_ranked() -> None:
    a, b = contiguous("a", largest=20_000, free=90_000), contiguous("b", largest=60_000)
    assert rank(a, b, demand=25_300, cached={"a": 24_000}) == ["b"]


def test_loaded_nodes_never_win_by_affinity() -> None:
    queueing = paged("a", free=150_000, pressure="queue")
    assert rank(queueing, paged("b", free=40_000), demand=25_300, cached={"a": 24_000}) == ["b"]
    # Nearly full (utilisation above max_utilisation): it keeps its place in the fit order,
    # here behind the empty node (the short-request order balances load).
    full, empty = paged("a", free=15_000), paged("c", free=150_000)
    assert rank(full, empty, demand=25_300, cls="short", cached={"a": 24_000}) == ["c", "a"]
    roomy = paged("a", free=60_000)
    assert rank(roomy, empty, demand=25_300, cls="short", cached={"a": 24_000}) == ["a", "c"]


def test_a_small_saving_leaves_the_fit_order_alone() -> None:
    a, b = paged("a", free=150_000, inflight=3), paged("b", free=40_000)
    assert rank(a, b, demand=25_300, cached={"a": 256}) == ["b", "a"]


def test_paged_queueing_servers_reuse_cached_blocks_contiguous_ones_do_not() -> None:
    # 10k free; 25k demand of which 24k cached: a vLLM-like server allocates ~1.3k new.
    assert rank(paged("a", free=10_000), demand=25_300, cached={"a": 24_000}) == ["a"]
    assert rank(paged("a", free=10_000), demand=25_300) == []
    assert rank(contiguous("c", largest=10_000), demand=25_300, cached={"c": 24_000}) == []
    off = AffinitySettings(discount_paged=False)
    assert demand_on(paged("a", free=0), 25_300, {"a": 24_000}, off) == 25_300
    assert demand_on(paged("a", free=0), 25_300, {"a": 24_000}, AffinitySettings()) == 1_300


def test_session_prefers_its_last_node_within_the_same_rules() -> None:
    # Short requests go to the fragmented/busier general node first by default.
    a = contiguous("a", largest=3_000, free=50_000)
    b = contiguous("b", largest=100_000, free=100_000)
    assert rank(a, b, demand=300, cls="short") == ["a", "b"]
    assert rank(a, b, demand=300, cls="short", session_node="b") == ["b", "a"]
    # ... never where it does not fit.
    tiny = contiguous("b", largest=100, free=100)
    assert rank(a, tiny, demand=300, cls="short", session_node="b") == ["a"]


def test_affinity_can_be_switched_off() -> None:
    policy = KvroutePolicy(
        PolicySettings(long_threshold_tokens=8_000, affinity=AffinitySettings(enabled=False))
    )
    snap = FleetSnapshot((paged("a", free=150_000, inflight=3), paged("b", free=40_000)))
    req = RouteRequest(25_300, "long", cached={"a": 24_000}, session_node="a")
    assert policy.rank(snap, req, now=1.0) == ["b", "a"]
    # And a disabled discount does not let a request into a node it does not fit.
    snap = FleetSnapshot((replace(paged("a", free=10_000)),))
    assert policy.rank(snap, req, now=1.0) == []


def test_a_new_prefix_spreads_to_the_paged_node_holding_least_cached_content() -> None:
    a, b = paged("a", free=150_000), paged("b", free=150_000)
    # Nothing cached anywhere: by name (equal nodes) without the index sizes ...
    assert rank(a, b, demand=25_300) == ["a", "b"]
    # ... to b, whose cache holds less of what the gateway sent, with them.
    assert rank(a, b, demand=25_300, indexed={"a": 90_000, "b": 10_000}) == ["b", "a"]
    # Contiguous candidates keep best fit: there, big blocks matter more than cache content.
    c, d = contiguous("c", largest=60_000), contiguous("d", largest=100_000)
    assert rank(c, d, demand=25_300, indexed={"c": 90_000, "d": 0}) == ["c", "d"]


def test_the_gateway_forgets_a_node_that_restarted_and_remembers_sessions() -> None:
    from proxy.config import parse_config
    from proxy.gateway.affinity import Affinity, AffinityKey

    cfg = parse_config(
        {"backends": [{"name": "a", "url": "http://127.0.0.1:1", "kind": "vllm"}]}, "t", {}
    )
    aff = Affinity(cfg)
    key = AffinityKey(tuple(block_hashes(list(range(64 * BS)), BS)), session="m|s1")
    node = paged("a", free=150_000)
    snap = FleetSnapshot((node,))
    base = RouteRequest(64 * BS + 100, "short")
    aff.placed(key, "a", now=1.0)
    req = aff.route_request(key, base, snap, now=2.0)
    assert req.cached == {"a": 64 * BS} and req.session_node == "a"
    # A discounted reservation on the paged node that holds the prefix.
    assert aff.demand_on(req, snap, "a") == 100
    restarted = replace(node, report=replace(node.report, started_at=50.0))  # type: ignore[type-var]
    req = aff.route_request(key, base, FleetSnapshot((restarted,)), now=3.0)
    assert req.cached == {} and req.session_node == "a"
