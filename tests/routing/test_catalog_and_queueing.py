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
from proxy.core.slot_limit import CONFIRMATIONS, DECAY_S, SlotLimit, next_slot_limit  # noqa: E402
from proxy.routing import KvroutePolicy, PolicySettings, RouteRequest  # noqa: E402


def busy(
    name: str, role: str = "general", running: int = 0, waiting: int = 0, slots: int = 8, **ov: int
) -> NodeView:
    report = MemoryReport(
        24_000, 20_000, 20_000, "paged", 16, running=running, waiting=waiting,
        max_num_seqs=slots, queueing=True, reported_at=1.0,
    )  # fmt: skip
    # The gateway sent every request the report shows, unless the test says otherwise: the
    # slot order counts the gateway's own flights (``proxy.routing.queueing.occupied``).
    ov.setdefault("inflight", running + waiting)
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


def _slot_report(
    running: int, waiting: int, at: float, free: int = 20_000, limit: int = 0
) -> MemoryReport:
    return MemoryReport(
        24_000, free, free, "paged", 16, running=running, waiting=waiting,
        max_num_seqs=limit, queueing=True, reported_at=at,
    )  # fmt: skip


def _learn(reports: list[tuple[int, int]], start: float = 1.0, every: float = 1.0) -> SlotLimit:
    state = SlotLimit()
    for i, (running, waiting) in enumerate(reports):
        at = start + i * every
        state = next_slot_limit(state, _slot_report(running, waiting, at), at)
    return state


def test_the_slot_limit_is_learned_from_reports_or_configured() -> None:
    pinned = [(6, 2)] * CONFIRMATIONS
    assert _learn([(5, 0)] * 5).limit == 0  # nothing waits: the limit is not reached
    assert _learn([(6, 2)] * (CONFIRMATIONS - 1)).limit == 0  # not yet pinned long enough
    assert _learn(pinned).limit == 6  # waiting with KV to spare at one running count
    assert _learn([*pinned, (8, 0)]).limit == 8  # more ran since: the limit is at least that
    st = BackendStatus()
    for i in range(CONFIRMATIONS):
        learned = st.with_slots(_slot_report(6, 2, at=1.0 + i), None)
    assert learned.max_num_seqs == 6 and st.slots_source == "learned"
    assert st.with_slots(_slot_report(3, 0, at=9.0), None).max_num_seqs == 6  # kept
    assert st.with_slots(_slot_report(3, 0, at=10.0), 16).max_num_seqs == 16  # configured wins
    assert st.slots_source == "configured"
    exported = st.with_slots(_slot_report(3, 0, at=11.0, limit=32), 16)
    assert exported.max_num_seqs == 32 and st.slots_source == "exported"  # exported wins


def test_waiting_for_kv_is_not_a_slot_limit() -> None:
    state = SlotLimit()
    for i in range(10):
        report = _slot_report(5, 2, at=1.0 + i, free=1_000)
        state = next_slot_limit(state, report, 1.0 + i)
    assert state.limit == 0


def test_a_learned_limit_cannot_stay_below_the_engines_while_the_gateway_keeps_it_there() -> None:
    """Issue 53: an engine allowing 256 that prefills one prompt at a time shows requests
    waiting with KV free at 26-30 running; the gateway, ranking by whatever it learned, keeps
    it there. The old rule took the first such count as the limit and only ever raised it
    (to 30 here), for good. Now a moving running count is a prefill queue, not a slot limit,
    and a figure once learned lapses unless the engine shows it again."""
    prefill_bound = [(26 + (i % 5), 3) for i in range(300)]  # 5 minutes, one report a second
    assert _learn(prefill_bound).limit == 0
    # A real limit of 8 is learned, and a gateway that then keeps the engine at 6 (never
    # pinned, never more) does not keep the figure: it lapses within DECAY_S and a report.
    learned = _learn([(8, 4)] * CONFIRMATIONS)
    assert learned.limit == 8
    state, at = learned, float(CONFIRMATIONS)
    while at < CONFIRMATIONS + DECAY_S + 2:
        at += 1.0
        state = next_slot_limit(state, _slot_report(6, 0, at), at)
    assert state.limit == 0
    # Probed upward: the engine, no longer capped by the figure, runs more, and is pinned
    # again only at its real limit.
    for running in (10, 14, 20, 20, 20):
        at += 1.0
        state = next_slot_limit(state, _slot_report(running, 3, at), at)
    assert state.limit == 20


def test_expected_wait_counts_the_gateways_own_requests_in_flight() -> None:
    # The same report (running 2, waiting 0) for both; the gateway has 12 requests of its own in
    # flight on "a" (sent since that report) and 2 on "b". "a" must not win on its name.
    busy_a = busy("a", running=2, inflight=12, reserved_tokens=12 * 1_000)
    idle_b = busy("b", running=2, inflight=2, reserved_tokens=2 * 1_000)
    rates = Rates()
    assert expected_wait_s(busy_a, 500, 600, rates) > expected_wait_s(idle_b, 500, 600, rates)
    order = rank_by_wait([busy_a, idle_b], 500, 600, "short", QueueingSettings())
    assert [name for name, _ in order] == ["b", "a"]


def test_the_expected_wait_leaves_slot_waits_out_where_a_limit_is_not_known() -> None:
    # "known" has 4 running at its limit of 4 and nothing queued; "unknown" (no limit learned
    # yet: vLLM does not export it) runs 12 with 3 waiting. With a slot wait counted only on
    # "known", "unknown" looked faster and a hold sent its request to the longer line.
    known = busy("known", running=4, slots=4, reserved_tokens=4 * 1_000)
    unknown = busy("unknown", running=12, waiting=3, slots=0, reserved_tokens=15 * 1_000)
    order = rank_by_wait([known, unknown], 500, 600, "short", QueueingSettings())
    assert [name for name, _ in order] == ["known", "unknown"]
    # Among servers whose limits are all known the slot wait still counts: a full server's
    # line waits for a slot, a server with one free starts at once (without the slot wait
    # the two tie, and the name would put "known" first).
    spare = busy("spare", running=3, slots=4, reserved_tokens=3 * 1_000)
    order = rank_by_wait([known, spare], 500, 600, "short", QueueingSettings())
    assert [name for name, _ in order] == ["spare", "known"]
    # One server alone (the TTFT check's prediction) keeps its slot wait.
    assert expected_wait_s(known, 500, 600, Rates()) > expected_wait_s(spare, 500, 600, Rates())
