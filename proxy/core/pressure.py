"""Queue and preemption signals: a node that is queueing or preempting is full for new work.

vLLM, SGLang and TGI never refuse work for lack of KV: they queue it, or (vLLM, SGLang)
preempt running requests and recompute them later. Either way the next request sent there
waits, whatever the KV figures say. So a node counts as full for new work when its report
shows requests waiting, its cumulative preemption counter rose since the previous report,
its running requests reached ``max_num_seqs`` (when known) or it is asleep.

Hysteresis: a node that turned full stays full until ``hold_s`` seconds pass with no
trigger, so one empty report between two busy ones does not flip it back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.core.fleet import MemoryReport
from proxy.core.slot_limit import SLOT_FREE_FRACTION

Reason = Literal["", "queue", "slots", "preemption", "asleep"]
"""Why a node is full: requests waiting with little KV free (``queue``), waiting with KV to
spare (``slots``: max_num_seqs ran out first), a rising preemption count, or sleep mode."""


@dataclass(frozen=True, slots=True)
class PressureConfig:
    hold_s: float = 5.0


@dataclass(frozen=True, slots=True)
class NodePressure:
    """One node's state: ``reason`` is empty when it may take new work."""

    reason: Reason = ""
    last_trigger_at: float = 0.0
    preemptions: int | None = None  # the counter at the previous report
    reported_at: float = -1.0  # the report last taken in (the same report is taken once)

    @property
    def full(self) -> bool:
        return self.reason != ""


def trigger(report: MemoryReport, previous_preemptions: int | None) -> Reason:
    """What in this report alone makes the node full now ("" when nothing does)."""
    if report.sleeping:
        return "asleep"
    if previous_preemptions is not None and report.preemptions > previous_preemptions:
        return "preemption"
    if report.max_num_seqs and report.running >= report.max_num_seqs:
        return "slots"
    if report.waiting > 0:
        return "slots" if report.free_fraction > SLOT_FREE_FRACTION else "queue"
    return ""


def next_pressure(
    prev: NodePressure, report: MemoryReport, now: float, cfg: PressureConfig
) -> NodePressure:
    """The node's state after one more report (pure: the tracker below keeps the map)."""
    if report.reported_at <= prev.reported_at:
        return prev
    seen = report.preemptions, report.reported_at
    reason = trigger(report, prev.preemptions)
    if reason:
        return NodePressure(reason, now, *seen)
    if prev.full and now - prev.last_trigger_at < cfg.hold_s:
        return NodePressure(prev.reason, prev.last_trigger_at, *seen)
    return NodePressure("", prev.last_trigger_at, *seen)


@dataclass
class PressureTracker:
    """Per-node pressure across reports.

    Feed it every report the gateway reads (from the store or the collector's hook): a
    report already taken in (same ``reported_at``) changes nothing, so calling it on every
    fleet snapshot is safe.
    """

    config: PressureConfig = field(default_factory=PressureConfig)
    nodes: dict[str, NodePressure] = field(default_factory=dict)

    def observe(self, name: str, report: MemoryReport, now: float) -> NodePressure:
        state = next_pressure(self.nodes.get(name, NodePressure()), report, now, self.config)
        self.nodes[name] = state
        return state

    def reason(self, name: str, now: float) -> Reason:
        """Why ``name`` is full now: a trigger seen within the last ``hold_s`` seconds."""
        state = self.nodes.get(name)
        if state is None or not state.full or now - state.last_trigger_at >= self.config.hold_s:
            return ""
        return state.reason

    def forget(self, name: str) -> None:
        self.nodes.pop(name, None)
