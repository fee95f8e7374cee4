"""Where the memory-pressure projection decides a node's fit and the store does not recheck
(``MemoryPressure.decided_here``). Pure: a view, this replica's flights, no I/O.

The end-to-end side (a real engine, the store's refusal seen as a queue hand-over) is
``tests/e2e/test_memory_pressure_e2e.py::test_the_projection_decides_the_fit_not_the_rule_of_full_demands``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import SimpleNamespace
from typing import cast

from prometheus_client import CollectorRegistry

from proxy.config import parse_config
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.projection import Flight
from proxy.gateway.context import RequestContext
from proxy.gateway.memory_pressure import MemoryPressure

LAZY = MemoryReport(
    capacity_tokens=10_000,
    free_tokens=6_000,
    largest_free_block_tokens=6_000,
    allocator="paged",
    queueing=True,
)


def pressure(enabled: bool = True, clock: Callable[[], float] | None = None) -> MemoryPressure:
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
    return MemoryPressure(cfg, CollectorRegistry(), clock)


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


def _ctx(rid: str, prompt: int, out: int, counts_request: bool = True) -> RequestContext:
    """What the projection reads of a request (its expected output already worked out)."""
    ctx = SimpleNamespace(
        reservation_id=rid,
        prompt_tokens=prompt,
        demand=prompt + out,
        expected_output=(out, out),
        counts_request=counts_request,
    )
    return cast(RequestContext, ctx)


def test_room_a_flight_freed_since_the_report_is_free_at_once_and_counted_once() -> None:
    now = [100.0]
    mp = pressure(clock=lambda: now[0])
    # Read at 100: 8,000 of 10,000 used, all of it this replica's two flights.
    report = replace(LAZY, free_tokens=2_000, largest_free_block_tokens=2_000, reported_at=100.0)
    doc, step_1 = _ctx("doc", 5_000, 1_000), _ctx("step1", 1_500, 500, counts_request=False)
    mp.flights["a"] = {"doc": Flight(5_000, 1_000, 1_000), "step1": Flight(1_500, 500, 500)}
    mp.flights["a"]["doc"].generated = 1_000
    mp.flights["a"]["step1"].generated = 500
    new = _ctx("new", 4_000, 1_000)

    def room(r: MemoryReport) -> int:
        view = mp.apply(FleetSnapshot((NodeView("a", report=r),)), new, now[0])
        return view.nodes[0].usable_block()

    before = room(report)
    assert before < new.demand
    # The document ends at 101: its 6,000 tokens are free now, though the report (100)
    # still shows them.
    now[0] = 101.0
    mp.ended(doc, "a")
    after = room(report)
    assert after == before + 6_000 >= new.demand
    # The next report (102) shows them freed itself: they are not taken out twice.
    fresh = replace(report, free_tokens=8_000, largest_free_block_tokens=8_000, reported_at=102.0)
    assert room(fresh) == after
    # Step 1 of a two-step request leaves its blocks on the prefill server until they are
    # pulled: its end frees nothing there.
    now[0] = 103.0
    mp.ended(step_1, "a")
    # Its 2,000 tokens stay as usage no flight explains: 10,000 less them.
    assert room(fresh) == 8_000
