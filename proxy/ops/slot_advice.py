"""``/fleet/advice``'s ``slot_layout`` part: llama.cpp servers whose slots are too small.

A llama.cpp server started without ``--kv-unified`` splits its context into ``-np`` slots of
``n_ctx / np`` cells each. A request longer than one slot fails there (or is kept away by the
gateway's fit check) however much the other slots have free, and that is not fragmentation:
a restart starts the same slots again. So these servers are never restart candidates
(``node_advice.update_below_since``, ``advice.decide``), and what does help is said here, in
llama.cpp's own terms: one pool all slots share (``--kv-unified``), fewer slots (``-np``) or a
larger context (``-c``). Pure: reads the failures and the snapshot, decides nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from proxy.core.fleet import FleetSnapshot
from proxy.ops.diagnosis import Failure

FIX = "start it with --kv-unified (one pool all slots share), fewer slots (-np) or a larger -c"


def slot_layout_advice(
    partitioned: Collection[str], failures: Iterable[Failure], snap: FleetSnapshot | None
) -> dict[str, Any]:
    """Per partitioned server that had room in total for a failed request but no slot that
    large: the largest such request and its largest slot now; one sentence for all."""
    failed: dict[str, int] = {}
    for f in failures:
        for name in f.room_on:
            if name in partitioned:
                failed[name] = max(failed.get(name, 0), f.demand)
    reports = {n.name: n.report for n in (snap.nodes if snap is not None else ())}
    nodes = {}
    for name, demand in sorted(failed.items()):
        report = reports.get(name)
        nodes[name] = {
            "failed_demand_tokens": demand,
            "context_tokens": report.capacity_tokens if report is not None else None,
            "largest_idle_slot_tokens": (
                report.largest_free_block_tokens if report is not None else None
            ),
        }
    if not nodes:
        return {"servers": {}, "reason": "no request failed for want of a large enough slot"}
    names = ", ".join(nodes)
    return {
        "servers": nodes,
        "reason": (
            f"{names}: partitioned slots, each a share of the context; requests of up to "
            f"{max(failed.values())} tokens had room in total but no slot that large. A restart "
            f"starts the same slots again: {FIX}"
        ),
    }
