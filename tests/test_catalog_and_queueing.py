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
