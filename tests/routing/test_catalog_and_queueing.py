"""Pure rules: which backends serve a model, and the expected-wait ranking of queueing nodes."""

from __future__ import annotations

from proxy.core.catalog import BackendModels, Catalog
from proxy.core.fleet import MemoryReport, NodeView, Overlay
from proxy.routing.queueing import QueueingSettings, Rates, expected_wait_s, rank_by_wait

CAT = Catalog(
    (
        BackendModels("a", ("alpha",), {"alpha": 4000}),
        BackendModels("b", ("alpha", "beta"), {"alpha": 2000, "beta": None}),
        BackendModels("c", None),
    )
)


def test_model_route_rules_out_backends_that_do_not_serve_it() -> None:
    route = CAT.route("beta", pass_through=False)
    assert route is not None and route.ruled_out == {"a"} and route.limit is None
    alpha = CAT.route("alpha", pass_through=False)
    assert alpha is not None and alpha.ruled_out == frozenset() and alpha.limit == 4000
    assert CAT.too_small("alpha", 3000) == {"b"}


def test_unknown_model_is_404_only_when_every_list_is_known() -> None:
    known = Catalog(CAT.backends[:2])
    assert known.route("gamma", pass_through=False) is None
    passed = known.route("gamma", pass_through=True)
    assert passed is not None and passed.ruled_out == frozenset() and passed.passed_through
    # "c" has not said what it serves: it may serve gamma.
    maybe = CAT.route("gamma", pass_through=False)
    assert maybe is not None and maybe.ruled_out == {"a", "b"}


def node(name: str, role: str = "general", waiting: int = 0, free: int = 100_000) -> NodeView:
    report = MemoryReport(
        100_000, free, free, "paged", 16, running=1, waiting=waiting, queueing=True
    )
    return NodeView(name, role=role, report=report, overlay=Overlay())  # type: ignore[arg-type]


def test_expected_wait_grows_with_the_queue_and_the_kv_deficit() -> None:
    rates = Rates(10_000.0, 30.0)
    idle = expected_wait_s(node("x"), 1_000, 1_200, rates)
    queued = expected_wait_s(node("x", waiting=10), 1_000, 1_200, rates)
    short_of_kv = expected_wait_s(node("x", free=200), 1_000, 1_200, rates)
    assert idle < queued and idle < short_of_kv


def test_long_requests_spill_from_the_long_pool_only_beyond_the_margin() -> None:
    settings = QueueingSettings(spill_margin_s=1.0)
    busy_long = node("L", role="long", waiting=20)  # 20 x 1000 tokens at 10k/s: ~2 s ahead
    general = node("G")
    order = rank_by_wait([busy_long, general], 20_000, 21_000, "long", settings)
    assert [n for n, _ in order] == ["G", "L"]
    lightly = node("L", role="long", waiting=5)  # ~0.5 s ahead: within the margin
    order = rank_by_wait([lightly, general], 20_000, 21_000, "long", settings)
    assert [n for n, _ in order] == ["L", "G"]


def test_long_pool_too_small_only_after_its_wait_stays_above_the_general_pools() -> None:
    from proxy.core.fleet import FleetSnapshot
    from proxy.routing.pool_sizing import PoolSizing

    settings = QueueingSettings(spill_margin_s=1.0)
    busy = FleetSnapshot((node("L", role="long", waiting=40), node("G")), taken_at=0.0)
    sizing = PoolSizing(window_s=30.0)
    assert sizing.observe(busy, 0.0, settings, 8_000, 1e9) == "ok"
    assert sizing.observe(busy, 10.0, settings, 8_000, 1e9) == "ok"
    assert sizing.observe(busy, 31.0, settings, 8_000, 1e9) == "long_pool_too_small"
    calm = FleetSnapshot((node("L", role="long"), node("G")), taken_at=0.0)
    assert sizing.observe(calm, 32.0, settings, 8_000, 1e9) == "ok"
    assert sizing.observe(busy, 33.0, settings, 8_000, 1e9) == "ok"  # the window starts again
    out = sizing.to_json("ok")
    assert out["pools"]["long"]["nodes"] == 1  # type: ignore[index]


# --- the kvroute policy on queueing nodes -----------------------------------------------------

from proxy.backends.scrape import BackendStatus  # noqa: E402
from proxy.core.fleet import FleetSnapshot  # noqa: E402
from proxy.core.pressure import learned_slots  # noqa: E402
from proxy.routing import KvroutePolicy, PolicySettings, RouteRequest  # noqa: E402


def busy(
    name: str, role: str = "general", running: int = 0, waiting: int = 0, slots: int = 8, **ov: int
) -> NodeView:
    report = MemoryReport(
        24_000, 20_000, 20_000, "paged", 16, running=running, waiting=waiting,
        max_num_seqs=slots, queueing=True, reported_at=1.0,
    )  # fmt: skip
    return NodeView(name, role=role, report=report, overlay=Overlay(**ov))  # type: ignore[arg-type]


def ranked(*nodes: NodeView, demand: int = 300) -> list[str]:
    policy = KvroutePolicy(PolicySettings(long_threshold_tokens=3_000))
    cls = "long" if demand >= 3_000 else "short"
    return policy.rank(FleetSnapshot(tuple(nodes)), RouteRequest(demand, cls), now=1.0)


def test_a_free_slot_elsewhere_beats_a_full_own_pool_and_back_when_a_slot_frees() -> None:
    full_general = busy("g", running=8)
    long_pool = busy("L", role="long", running=3)
    # All of g's slots are taken: the short request starts now in the long pool.
    assert ranked(full_general, long_pool) == ["L", "g"]
    # One of g's requests ended: its own pool again (no hysteresis).
    assert ranked(busy("g", running=7), long_pool) == ["g", "L"]
    # Long requests: the long pool while it has a slot, a general node with one otherwise.
    assert ranked(busy("g", running=2), long_pool, demand=4_000) == ["L", "g"]
    full_long = busy("L", role="long", running=8)
    assert ranked(busy("g", running=2), full_long, demand=4_000) == ["g", "L"]


def test_a_node_whose_slots_alone_are_full_still_takes_work_ranked_by_its_queue() -> None:
    # Both pressured for slots (their KV has room): both ranked, the shorter queue first.
    a = busy("a", running=8, waiting=3, pressure="slots")  # type: ignore[arg-type]
    b = busy("b", running=8, waiting=1, pressure="slots")  # type: ignore[arg-type]
    assert ranked(a, b) == ["b", "a"]
    # Short of KV ("queue": waiting with the cache nearly full) stays full.
    c = busy("c", running=4, waiting=2, pressure="queue")  # type: ignore[arg-type]
    assert ranked(c) == []


def test_a_burst_on_one_snapshot_spreads_by_the_gateways_own_in_flight_count() -> None:
    # The same report for both; the gateway has sent three to "a" since (local view).
    a, b = busy("a", running=2, inflight=5), busy("b", running=2, inflight=2)
    assert ranked(a, b) == ["b", "a"]
    # Per engine: a data-parallel 2 node with 6 in flight is less loaded than a single with 4.
    dp = NodeView(
        "dp",
        report=MemoryReport(48_000, 40_000, 20_000, "paged", 16, running=6, queueing=True,
                            engines=2, engine_free_tokens=(20_000, 20_000), reported_at=1.0),
    )  # fmt: skip
    assert ranked(busy("one", running=4, slots=0), dp) == ["dp", "one"]


def test_the_slot_limit_is_learned_from_reports_or_configured() -> None:
    def rep(running: int, waiting: int, free: int = 20_000, limit: int = 0) -> MemoryReport:
        return MemoryReport(
            24_000, free, free, "paged", 16, running=running, waiting=waiting,
            max_num_seqs=limit, queueing=True,
        )  # fmt: skip

    assert learned_slots(0, rep(5, 0)) == 0  # nothing waits: the limit is not reached
    assert learned_slots(0, rep(5, 2, free=1_000)) == 0  # waiting for KV, not for a slot
    assert learned_slots(0, rep(6, 2)) == 6  # waiting with KV to spare: slots ran out
    assert learned_slots(6, rep(8, 0)) == 8  # more ran since: the limit is at least that
    st = BackendStatus()
    assert st.with_slots(rep(6, 2), None).max_num_seqs == 6
    assert st.with_slots(rep(3, 0), None).max_num_seqs == 6  # kept
    assert st.with_slots(rep(3, 0), 16).max_num_seqs == 16  # configured wins
    assert st.with_slots(rep(3, 0, limit=32), 16).max_num_seqs == 32  # exported wins


def test_expected_wait_counts_the_gateways_own_requests_in_flight() -> None:
    # The same report (running 2, waiting 0) for both; the gateway has 12 requests of its own in
    # flight on "a" (sent since that report) and 2 on "b". "a" must not win on its name.
    busy_a = busy("a", running=2, inflight=12, reserved_tokens=12 * 1_000)
    idle_b = busy("b", running=2, inflight=2, reserved_tokens=2 * 1_000)
    rates = Rates()
    assert expected_wait_s(busy_a, 500, 600, rates) > expected_wait_s(idle_b, 500, 600, rates)
    order = rank_by_wait([busy_a, idle_b], 500, 600, "short", QueueingSettings())
    assert [name for name, _ in order] == ["b", "a"]
