"""Replicas needed: the smallest fleet that keeps final failures under a target, per policy.

The arrival rate stays fixed while the fleet size N varies (the long pool keeps its share
of the fleet). Every policy's search advances one probe per round and the probes of a
round run in parallel. The search brackets N between a size that surely fails (the
offered KV load alone fills it) and one that passes, then bisects; it assumes failures
fall as N grows, which holds for every policy here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.sim.engine import SimConfig, with_nodes
from loadtest.sim.runner import Job, WorkloadSpec, offered_load, run_jobs


@dataclass
class ReplicaSearch:
    """One policy's search state and outcome (``needed`` None: more than ``max_nodes``)."""

    policy: str
    lo: int  # the largest N known (or assumed) to miss the target
    hi: int | None = None  # the smallest N known to meet it
    probes: dict[int, float] = field(default_factory=dict)  # N -> failure rate
    max_nodes: int = 64
    done: bool = False

    @property
    def needed(self) -> int | None:
        return self.hi

    def next_probe(self, start: int) -> int | None:
        if self.done:
            return None
        if self.hi is None:
            if not self.probes:
                return max(self.lo + 1, start)
            n = max(self.lo + 1, math.ceil(self.lo * 1.25))
            if n > self.max_nodes:
                self.done = True
                return None
            return n
        if self.hi - self.lo <= 1:
            self.done = True
            return None
        return (self.lo + self.hi) // 2

    def record(self, n: int, rate: float, target: float) -> None:
        self.probes[n] = rate
        if rate <= target:
            self.hi = n if self.hi is None else min(self.hi, n)
        else:
            self.lo = max(self.lo, n)
        if self.lo >= self.max_nodes:
            self.done = True


def replicas_needed(
    cfg: SimConfig,
    policies: Sequence[str],
    workload: WorkloadSpec,
    duration_s: float,
    target: float = 0.001,
    max_nodes: int = 64,
    workers: int = 1,
    show_progress: bool = True,
) -> dict[str, ReplicaSearch]:
    """Search every policy at once; ``cfg.nodes`` is where each search starts."""
    fill = offered_load(workload, cfg) * cfg.nodes  # fleet sizes the KV load alone fills
    floor = max(0, min(max_nodes - 1, math.floor(fill)))
    frac = cfg.long_pool / cfg.nodes if cfg.nodes else 0.0
    searches = {p: ReplicaSearch(p, lo=floor, max_nodes=max_nodes) for p in policies}
    while True:
        jobs: list[Job] = []
        for p, s in searches.items():
            n = s.next_probe(cfg.nodes)
            if n is not None:
                jobs.append(Job(f"{p}@{n}", with_nodes(cfg, n, frac), p, workload, duration_s))
        if not jobs:
            return searches
        results = run_jobs(jobs, workers, show_progress, title="replicas")
        for key, res in results.items():
            name, size = key.rsplit("@", 1)
            searches[name].record(int(size), res.failure_rate, target)
