"""Is the long pool the right size? Compare the pools' expected waits (queueing backends).

The long pool protects short requests from long prefills; it is too small when a long
request's expected wait there (``proxy.routing.queueing``) stays above what it would be on
the best general node by more than the spill margin for ``window_s``: long requests then
spill, or wait for nothing. It is larger than needed when its expected wait stays below
the general pool's by the margin while the general pool is the one with a wait. Shown in
``GET /fleet/advice`` (``pools``). Pure: the caller keeps the tracker and feeds it snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.core.fleet import FleetSnapshot
from proxy.core.freshness import judged_at
from proxy.routing.queueing import QueueingSettings, Rates, expected_wait_s, is_queueing

Verdict = Literal["ok", "long_pool_too_small", "long_pool_larger_than_needed", "unknown"]


@dataclass(frozen=True, slots=True)
class PoolView:
    role: str
    nodes: int
    best_wait_s: float | None


@dataclass
class PoolSizing:
    """Tracks since when the long pool's expected wait has been off the general pool's."""

    window_s: float = 30.0
    off_since: float | None = None
    off_verdict: Verdict = "ok"
    last: dict[str, PoolView] = field(default_factory=dict)

    def observe(
        self,
        snap: FleetSnapshot,
        now: float,
        settings: QueueingSettings,
        long_threshold_tokens: int,
        stale_after_s: float,
    ) -> Verdict:
        """The verdict after this snapshot (a typical long request as the probe)."""
        probe_prompt, probe_demand = long_threshold_tokens, long_threshold_tokens + 256
        waits: dict[str, list[float]] = {"long": [], "general": []}
        judged = judged_at(snap, now, stale_after_s)
        for n in snap.nodes:
            if not n.up or n.report is None or not is_queueing(n):
                continue
            if judged - n.report.reported_at > stale_after_s:
                continue
            rates = settings.rates.get(n.name, Rates())
            waits[n.role].append(expected_wait_s(n, probe_prompt, probe_demand, rates))
        self.last = {
            role: PoolView(role, len(w), min(w) if w else None) for role, w in waits.items()
        }
        long_w, gen_w = self.last["long"].best_wait_s, self.last["general"].best_wait_s
        if long_w is None or gen_w is None:
            self.off_since = None
            return "unknown"
        now_verdict: Verdict = "ok"
        if long_w > gen_w + settings.spill_margin_s:
            now_verdict = "long_pool_too_small"
        elif gen_w > long_w + settings.spill_margin_s:
            now_verdict = "long_pool_larger_than_needed"
        if now_verdict != self.off_verdict or now_verdict == "ok":
            self.off_since = now if now_verdict != "ok" else None
            self.off_verdict = now_verdict
            return "ok"
        since = self.off_since if self.off_since is not None else now
        return now_verdict if now - since >= self.window_s else "ok"

    def to_json(self, verdict: Verdict) -> dict[str, object]:
        return {
            "verdict": verdict,
            "window_s": self.window_s,
            "pools": {
                role: {"nodes": v.nodes, "best_expected_wait_s": v.best_wait_s}
                for role, v in self.last.items()
            },
        }
