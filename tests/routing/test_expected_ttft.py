"""Cost-based placement of a cached prompt (``proxy.routing.expected_ttft``), pure."""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.routing import KvroutePolicy, PolicySettings, RouteRequest
from proxy.routing.expected_ttft import PrefillBacklog, by_expected_ttft, reported_wait_s, slack_s
from proxy.routing.node_cost import NodeCost

RATE = 10_000.0


def paged(name: str, free: int = 150_000, waiting: int = 0, inflight: int = 0) -> NodeView:
    report = MemoryReport(
        capacity_tokens=200_000,
        free_tokens=free,
        largest_free_block_tokens=free,
        allocator="paged",
        block_size=16,
        queueing=True,
        waiting=waiting,
    )
    return NodeView(name, report=report, overlay=Overlay(inflight=inflight))


def contiguous(name: str) -> NodeView:
    report = MemoryReport(200_000, 150_000, 150_000)
    return NodeView(name, report=report)


def rank(nodes: list[NodeView], costs: dict[str, NodeCost], cached: dict[str, int]) -> list[str]:
    prompt = 25_000
    req = RouteRequest(
        prompt + 200,
        "long",
        cached=cached,
        indexed={n.name: 0 for n in nodes},
        ttft=costs,
        ttft_slack_s=slack_s(prompt, costs, 0.25),
    )
    policy = KvroutePolicy(PolicySettings(long_threshold_tokens=8_000))
    return policy.rank(FleetSnapshot(tuple(nodes)), req, now=1.0)


def test_expected_ttft_is_the_backlog_plus_the_uncached_part_at_the_rate() -> None:
    assert NodeCost(backlog_s=1.5, uncached_tokens=5_000, tokens_per_s=RATE).ttft_s == 2.0
    assert NodeCost(0.0, 0, RATE).ttft_s == 0.0


def test_the_backlog_queues_prefills_one_after_another_and_drains_with_time() -> None:
    b = PrefillBacklog()
    assert b.wait_s("a", now=10.0, inflight=0, tokens_per_s=RATE) == 0.0
    b.add("a", 20_000, RATE, now=10.0)
    b.add("a", 10_000, RATE, now=10.5)
    # 2 s from 10.0, then 1 s more after it: empty at 13.0.
    assert b.wait_s("a", now=10.5, inflight=2, tokens_per_s=RATE) == 2.5
    assert b.wait_s("a", now=12.0, inflight=2, tokens_per_s=RATE) == 1.0
    assert b.wait_s("a", now=14.0, inflight=2, tokens_per_s=RATE) == 0.0
    # After an idle spell the next prefill starts now, not when the last one ended.
    b.add("a", 10_000, RATE, now=20.0)
    assert b.wait_s("a", now=20.0, inflight=1, tokens_per_s=RATE) == 1.0
    assert b.wait_s("b", now=20.0, inflight=1, tokens_per_s=RATE) == 0.0
    b.forget("a")
    assert b.wait_s("a", now=20.0, inflight=1, tokens_per_s=RATE) == 0.0
    # Nothing to prefill (all cached) or no rate: no backlog.
    b.add("a", 0, RATE, now=20.0)
    b.add("a", 5_000, 0.0, now=20.0)
    assert b.wait_s("a", now=20.0, inflight=2, tokens_per_s=RATE) == 0.0


def test_the_backlog_is_at_most_what_is_still_in_flight_there() -> None:
    # The clock says 3 s (it drains at a rate that may read low); only the newest request of
    # the three is still in flight: at most its 10k tokens, 1 s, are queued.
    b = PrefillBacklog()
    for tokens in (10_000, 10_000, 10_000):
        b.add("a", tokens, RATE, now=0.0)
    assert b.wait_s("a", now=0.0, inflight=3, tokens_per_s=RATE) == 3.0
    assert b.wait_s("a", now=0.0, inflight=1, tokens_per_s=RATE) == 1.0
    assert b.wait_s("a", now=0.0, inflight=0, tokens_per_s=RATE) == 0.0


def test_other_clients_waiting_requests_count_at_the_mean_size_of_ours() -> None:
    busy = paged("a", waiting=4, inflight=2)
    busy = NodeView("a", report=busy.report, overlay=Overlay(reserved_tokens=10_000, inflight=2))
    assert reported_wait_s(busy, RATE) == 4 * 5_000 / RATE
    assert reported_wait_s(paged("b", waiting=2), RATE) == 2 * 1_000 / RATE
    assert reported_wait_s(paged("c"), RATE) == 0.0


def test_the_owner_of_a_document_keeps_it_while_its_queue_is_short() -> None:
    # a holds 24k of the 25k prompt; b and c hold nothing. a's queue: 1 s < 2.4 s saved.
    a, b, c = paged("a"), paged("b"), paged("c")
    costs = {
        "a": NodeCost(1.0, 1_000, RATE),
        "b": NodeCost(0.0, 25_000, RATE),
        "c": NodeCost(0.5, 25_000, RATE),
    }
    assert rank([a, b, c], costs, {"a": 24_000})[0] == "a"


def test_a_hot_document_spills_when_its_owners_queue_costs_more_than_recomputing() -> None:
    # a's queue: 5 s of prefill ahead; recomputing the 25k prompt on b: 2.5 s.
    a, b, c = paged("a"), paged("b"), paged("c")
    costs = {
        "a": NodeCost(5.0, 1_000, RATE),
        "b": NodeCost(0.0, 25_000, RATE),
        "c": NodeCost(0.4, 25_000, RATE),
    }
    order = rank([a, b, c], costs, {"a": 24_000})
    # b and c are within the slack (a quarter of the 2.5 s full prefill) of each other:
    # they keep the affinity order among them (the spread rule); a, slowest, is last.
    assert order[-1] == "a"
    assert set(order[:2]) == {"b", "c"}
    # A second copy already on c: it wins over recomputing on b.
    costs["c"] = NodeCost(0.4, 1_000, RATE)
    assert rank([a, b, c], costs, {"a": 24_000, "c": 24_000})[0] == "c"


def test_a_near_tie_goes_to_the_cache_not_to_the_shorter_queue() -> None:
    # a: 2.6 s (2.5 s queue + 0.1 s); b: 2.5 s, recomputing: within the slack (0.625 s).
    a, b = paged("a"), paged("b")
    costs = {"a": NodeCost(2.5, 1_000, RATE), "b": NodeCost(0.0, 25_000, RATE)}
    assert rank([a, b], costs, {"a": 24_000}) == ["a", "b"]
    # With no slack the faster one wins outright.
    assert by_expected_ttft([a, b], costs, slack_s=0.0) == [b, a]


def test_fail_fast_nodes_and_nodes_without_a_cost_keep_the_fit_order() -> None:
    a, b = paged("a"), paged("b")
    costs = {"a": NodeCost(9.0, 0, RATE)}
    assert by_expected_ttft([a, b], costs, 0.0) == [a, b]
    c, d = contiguous("c"), contiguous("d")
    both = {"c": NodeCost(9.0, 0, RATE), "d": NodeCost(0.0, 0, RATE)}
    assert by_expected_ttft([c, d], both, 0.0) == [c, d]


def test_slack_is_a_fraction_of_the_prompts_full_prefill_on_the_fastest_node() -> None:
    costs = {"a": NodeCost(0.0, 0, RATE), "b": NodeCost(0.0, 0, 2 * RATE)}
    assert slack_s(20_000, costs, 0.25) == 0.25
    assert slack_s(20_000, {}, 0.25) == 0.0
