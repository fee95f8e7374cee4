"""``/fleet/advice``'s memory_pressure part (proxy.ops.preemption_advice)."""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView
from proxy.core.preemption_headroom import PreemptionHeadroom
from proxy.ops.preemption_advice import preemption_advice


def fleet(*names: str) -> FleetSnapshot:
    report = MemoryReport(1000, 500, 500, allocator="paged", queueing=True)
    return FleetSnapshot(tuple(NodeView(n, report=report) for n in names))


def test_quiet_nodes_need_nothing() -> None:
    advice = preemption_advice(PreemptionHeadroom(), fleet("a", "b"))
    assert advice == {"tightened": {}, "reason": "no lazily allocating node preempted recently"}


def test_some_nodes_tightened_point_at_those_nodes() -> None:
    h = PreemptionHeadroom()
    h.observe("a", 0, 0.0)
    h.observe("a", 3, 1.0)
    advice = preemption_advice(h, fleet("a", "b"))
    assert advice["tightened"] == {"a": {"kv_budget_fraction": 0.95, "preemption_rises": 1}}
    assert advice["reason"].startswith("a preempted")


def test_every_node_tightened_means_scale_up() -> None:
    h = PreemptionHeadroom()
    for name in ("a", "b"):
        h.observe(name, 0, 0.0)
        h.observe(name, 1, 1.0)
    assert "scale up" in preemption_advice(h, fleet("a", "b"))["reason"]
    assert "scale up" not in preemption_advice(h, None)["reason"]
