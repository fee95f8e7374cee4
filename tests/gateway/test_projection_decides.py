"""Where the memory-pressure projection decides a node's fit and the store does not recheck
(``MemoryPressure.decided_here``). Pure: a view, this replica's flights, no I/O.

The end-to-end side (a real engine, the store's refusal seen as a queue hand-over) is
``tests/e2e/test_memory_pressure_e2e.py::test_the_projection_decides_the_fit_not_the_rule_of_full_demands``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from proxy.config import parse_config
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.projection import Flight
from proxy.gateway.memory_pressure import MemoryPressure

LAZY = MemoryReport(
    capacity_tokens=10_000,
    free_tokens=6_000,
    largest_free_block_tokens=6_000,
    allocator="paged",
    queueing=True,
)


def pressure(enabled: bool = True) -> MemoryPressure:
    cfg = parse_config(
        {
            "backends": [
                {"name": n, "url": f"http://127.0.0.1:{9000 + i}", "kind": "vllm"}
                for i, n in enumerate(("a", "b", "c"))
            ],
            "memory_pressure": {"enabled": enabled},
        },
        environ={},
    )
    return MemoryPressure(cfg, CollectorRegistry())


def node(name: str, reserved: int, projected: int | None = 1_000) -> NodeView:
    overlay = Overlay(reserved_tokens=reserved, projected_tokens=projected)
    return NodeView(name, report=LAZY, overlay=overlay)


def test_only_nodes_whose_every_reservation_is_this_replicas_skip_the_store_check() -> None:
    mp = pressure()
    # This replica holds one request on a and one on b: 3,000 + 1,000 at full demand each.
    mp.flights["a"] = {"r1": Flight(3_000, 1_000, 500)}
    mp.flights["b"] = {"r2": Flight(3_000, 1_000, 500)}
    view = FleetSnapshot(
        (
            node("a", reserved=4_000),  # all of it this replica's
            node("b", reserved=6_500),  # 2,500 more: another replica's reservation
            node("c", reserved=0, projected=None),  # no projection laid over it
        )
    )
    assert mp.decided_here(view, ["a", "b", "c"]) == {"a"}
    # Only the ranked candidates are asked about.
    assert mp.decided_here(view, ["b", "c"]) == frozenset()


def test_an_empty_node_is_decided_here_and_nothing_is_with_the_projection_off() -> None:
    view = FleetSnapshot((node("a", reserved=0),))
    assert pressure().decided_here(view, ["a"]) == {"a"}
    assert pressure(enabled=False).decided_here(view, ["a"]) == frozenset()
