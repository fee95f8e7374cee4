"""A node's preemptions say its projection was too generous: keep more of it spare (learned).

``proxy.core.projection`` places work where the projected peak fits. When the engine still
preempts (``vllm:num_preemptions_total`` rises), the projection undercounted on that node
(other clients, a different output mix, prefix blocks held longer). Each rise takes
``step`` more of the node's capacity out of the budget, down to ``floor``; every
``relax_s`` seconds without a rise gives one step back. A multiplicative-decrease,
slow-recovery rule, like a congestion window: a node that keeps preempting ends up with a
budget its real load fits, and one that stopped recovers its full capacity.

Pure: time comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class HeadroomSettings:
    step: float = 0.05
    floor: float = 0.6
    relax_s: float = 30.0


@dataclass(slots=True)
class NodeHeadroom:
    """One node: the fraction of capacity the projection may fill, and what changed it."""

    budget: float = 1.0
    preemptions: int | None = None  # the counter at the previous report
    last_rise_at: float = 0.0
    rises: int = 0


@dataclass
class PreemptionHeadroom:
    """Per-node budgets, fed with every report's preemption counter."""

    settings: HeadroomSettings = field(default_factory=HeadroomSettings)
    nodes: dict[str, NodeHeadroom] = field(default_factory=dict)

    def observe(self, name: str, preemptions: int, now: float) -> float:
        """Take in one report's cumulative counter; the node's budget after it."""
        node = self.nodes.setdefault(name, NodeHeadroom())
        s = self.settings
        if node.preemptions is not None and preemptions > node.preemptions:
            node.budget = max(s.floor, node.budget - s.step)
            node.last_rise_at = now
            node.rises += 1
        elif node.budget < 1.0 and now - node.last_rise_at >= s.relax_s:
            node.budget = min(1.0, node.budget + s.step)
            node.last_rise_at = now
        # A restarted engine counts from 0 again: the new level is the reference.
        node.preemptions = preemptions
        return node.budget

    def budget(self, name: str) -> float:
        node = self.nodes.get(name)
        return node.budget if node is not None else 1.0

    def forget(self, name: str) -> None:
        self.nodes.pop(name, None)
