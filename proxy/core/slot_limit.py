"""A queueing server's running-request limit, learned only from evidence the gateway cannot make.

vLLM does not export ``max_num_seqs``. The old rule read "requests waiting while KV has room
to spare" as "the slots ran out" and took the running count then as the limit. On an engine
that prefills one prompt at a time (or within a token budget per step), requests wait with
KV free and slots to spare: that rule learned 28-33 on engines allowing 256 (issue 53). Once
learned, the gateway ranked and held by that figure, the engine never ran more, and nothing
could show the figure wrong: a limit that fed itself.

So a limit is learned only from what a slot limit looks like and a prefill queue does not:

* **pinned**: ``waiting > 0`` with KV to spare in ``CONFIRMATIONS`` reports in a row, all
  at the *same* running count. A prefill-bound engine admits as prompts finish, so its
  running count moves from report to report; a slot-bound one sits at its limit. Requests
  held at the gateway never show as ``waiting`` on the engine, so the gateway's own holds
  cannot produce this evidence;
* **raised** by any report that runs more (no report can run more than the limit);
* **decays**: the figure lapses ``DECAY_S`` after it was last confirmed or raised, back to
  unknown (no slot term in the expected wait), which probes upward: if the engine then runs
  more, the next figure is higher; if it is pinned again, it is learned again.

Pure: the collector (``proxy.backends.scrape.BackendStatus``) keeps one per backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proxy.core.fleet import MemoryReport

# Waiting with more than this fraction of KV free: the wait is not for KV.
SLOT_FREE_FRACTION = 0.2
# Reports in a row pinned at one running count before it is taken as the limit.
CONFIRMATIONS = 3
# Seconds a learned figure stands without a new confirmation or a raise.
DECAY_S = 60.0

SlotSource = Literal["unknown", "exported", "configured", "learned"]


@dataclass(frozen=True, slots=True)
class SlotLimit:
    """What is known of one server's limit: the figure, and the evidence being gathered."""

    limit: int = 0  # 0: unknown
    confirmed_at: float = 0.0
    # The running count seen with waiting and KV to spare, and in how many reports in a row.
    candidate: int = 0
    streak: int = 0
    reported_at: float = -1.0  # the report last taken in (the same report counts once)


def waits_with_room(report: MemoryReport) -> bool:
    """Requests wait on the engine while its KV has room to spare (slots, or prefill)."""
    return report.waiting > 0 and report.free_fraction > SLOT_FREE_FRACTION


def next_slot_limit(prev: SlotLimit, report: MemoryReport, now: float) -> SlotLimit:
    """The limit after one more report (``now``: the collector's clock)."""
    if report.reported_at <= prev.reported_at and prev.reported_at >= 0:
        return prev
    limit, confirmed_at = prev.limit, prev.confirmed_at
    if limit and now - confirmed_at > DECAY_S:
        limit = 0
    if limit and report.running > limit:
        # More ran than the figure allows: the figure was low.
        limit, confirmed_at = report.running, now
    candidate, streak = 0, 0
    if waits_with_room(report) and report.running > 0:
        same = report.running == prev.candidate
        candidate, streak = report.running, (prev.streak + 1 if same else 1)
        if streak >= CONFIRMATIONS and report.running >= limit:
            limit, confirmed_at = report.running, now
    return SlotLimit(limit, confirmed_at, candidate, streak, report.reported_at)
