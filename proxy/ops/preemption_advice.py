"""``/fleet/advice``'s ``memory_pressure`` part: nodes whose preemptions tightened their budget.

A lazily allocating engine that keeps preempting under the gateway's projection has less
room than the projection assumed (other clients, longer outputs than learned, a smaller
cache than reported). The gateway already reacts (it fills that node less,
``proxy.core.preemption_headroom``); this says so to the operator with the numbers, and
what helps: more replicas when every node is tightened, a look at that node otherwise.
Pure: reads the budgets, decides nothing.
"""

from __future__ import annotations

from typing import Any

from proxy.core.fleet import FleetSnapshot
from proxy.core.preemption_headroom import PreemptionHeadroom


def preemption_advice(headroom: PreemptionHeadroom, snap: FleetSnapshot | None) -> dict[str, Any]:
    """Per tightened node its budget and rises, and one sentence for the whole fleet."""
    lazy_nodes = [
        n.name
        for n in (snap.nodes if snap is not None else ())
        if n.report is not None and n.report.queueing
    ]
    tightened = {
        name: {"kv_budget_fraction": round(node.budget, 3), "preemption_rises": node.rises}
        for name, node in sorted(headroom.nodes.items())
        if node.budget < 1.0
    }
    if not tightened:
        why = "no lazily allocating node preempted recently"
    elif lazy_nodes and set(tightened) >= set(lazy_nodes):
        why = (
            "every lazily allocating node preempts under the gateway's projection: the fleet "
            "lacks KV for this output mix; scale up (the gateway holds requests meanwhile)"
        )
    else:
        why = (
            f"{', '.join(tightened)} preempted: the gateway fills them less; check for clients "
            "that bypass the gateway or a smaller cache than reported"
        )
    return {"tightened": tightened, "reason": why}
