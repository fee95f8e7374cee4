"""Run several simulations (policies, fleet sizes) on up to ``jobs`` processes with progress.

Workloads travel to worker processes as a small picklable ``WorkloadSpec`` and are
regenerated there from the seed, so every policy sees exactly the same requests.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import Manager
from typing import Any

from loadtest.sim.engine import SimConfig, SimResult, simulate
from loadtest.sim.workload import mix_stream, problem_mix, trace_stream
from loadtest.workload import MixClass, Request, load_trace


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A request stream, described rather than materialised (picklable, seeded)."""

    kind: str = "mix"  # "mix" (parametric, the problem's by default) or "trace"
    rate_per_s: float = 3.75  # mix only
    mix: tuple[MixClass, ...] = field(default_factory=lambda: tuple(problem_mix()))
    trace: str | None = None
    length_scale: float = 1.0
    rate_scale: float = 1.0
    seed: int = 1

    def stream(self, duration_s: float, long_threshold: int) -> Iterator[Request]:
        if self.kind == "trace":
            if not self.trace:
                raise ValueError("trace workload needs a trace file")
            return trace_stream(
                self.trace, duration_s, self.length_scale, self.rate_scale, long_threshold
            )
        return mix_stream(self.mix, self.rate_per_s, duration_s, self.seed)

    def describe(self) -> dict[str, Any]:
        if self.kind == "trace":
            return {
                "kind": "trace",
                "trace": self.trace,
                "length_scale": self.length_scale,
                "rate_scale": self.rate_scale,
            }
        return {
            "kind": "mix",
            "rate_per_s": self.rate_per_s,
            "mix": [
                {
                    "kind": c.kind,
                    "share": c.share,
                    "prompt": list(c.prompt),
                    "output": list(c.output),
                }
                for c in self.mix
            ],
            "seed": self.seed,
        }


def kv_load_per_request(
    spec: WorkloadSpec, cfg: SimConfig, sample: int = 20_000
) -> tuple[float, float]:
    """(mean token-seconds of KV one request holds while it runs, arrival rate at scale 1),
    by sampling. ``--load`` uses it: offered KV load = rate x token-seconds / fleet capacity
    (retained session KV is left out: it is a property of the stack, not of the traffic).
    """
    if spec.kind == "trace":
        if not spec.trace:
            raise ValueError("trace workload needs a trace file")
        reqs = load_trace(
            spec.trace, spec.length_scale, 1.0, long_threshold=cfg.settings.long_threshold_tokens
        )
        if len(reqs) < 2:
            raise ValueError(f"{spec.trace}: a trace needs at least 2 requests")
        span = max(1e-9, reqs[-1].arrival_s - reqs[0].arrival_s)
        rate = (len(reqs) - 1) / span
    else:
        rng = random.Random(spec.seed)
        reqs = []
        total = sum(c.share for c in spec.mix)
        for _ in range(sample):
            u, acc = rng.random() * total, 0.0
            c = spec.mix[-1]
            for m in spec.mix:
                acc += m.share
                if u < acc:
                    c = m
                    break
            reqs.append(Request(0.0, rng.randint(*c.prompt), rng.randint(*c.output), c.kind))
        rate = 1.0
    ts = 0.0
    for r in reqs:
        life = r.prompt_tokens / cfg.prefill_tps + r.output_tokens / cfg.decode_tps
        ts += (r.prompt_tokens + r.output_tokens) * life
    return ts / len(reqs), rate


def at_load(spec: WorkloadSpec, cfg: SimConfig, load: float) -> WorkloadSpec:
    """The same workload with its arrival rate set so the offered KV load is ``load`` of the fleet."""
    if load <= 0:
        raise ValueError("load must be positive")
    ts, base_rate = kv_load_per_request(spec, cfg)
    rate = load * cfg.nodes * cfg.capacity_tokens / ts
    if spec.kind == "trace":
        return replace(spec, rate_scale=rate / base_rate)
    return replace(spec, rate_per_s=rate)


def offered_load(spec: WorkloadSpec, cfg: SimConfig) -> float:
    ts, base_rate = kv_load_per_request(spec, cfg)
    rate = base_rate * spec.rate_scale if spec.kind == "trace" else spec.rate_per_s
    return rate * ts / (cfg.nodes * cfg.capacity_tokens)


@dataclass(frozen=True, slots=True)
class Job:
    key: str
    cfg: SimConfig
    policy: str
    workload: WorkloadSpec
    duration_s: float


def _run_job(job: Job, shared: Any = None) -> SimResult:
    last = [0.0]

    def progress(t: float) -> None:
        now = time.monotonic()
        if shared is not None and (now - last[0] > 0.5 or t >= job.duration_s):
            last[0] = now
            shared[job.key] = t

    stream = job.workload.stream(job.duration_s, job.cfg.settings.long_threshold_tokens)
    return simulate(job.cfg, job.policy, stream, job.duration_s, progress)


def _bar_updater(bar: Any, task: Any) -> Callable[[float], None]:
    def update(t: float) -> None:
        bar.update(task, completed=t)

    return update


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def run_jobs(
    jobs: Sequence[Job],
    workers: int = 1,
    show_progress: bool = True,
    title: str = "simulating",
) -> dict[str, SimResult]:
    """Run every job; results by key. A rich progress bar per job in simulated time."""
    if not jobs:
        return {}
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not show_progress, transient=True) as bar:
        tasks = {j.key: bar.add_task(f"{title} {j.key}", total=j.duration_s) for j in jobs}
        if workers <= 1:
            out: dict[str, SimResult] = {}
            for j in jobs:
                stream = j.workload.stream(j.duration_s, j.cfg.settings.long_threshold_tokens)
                out[j.key] = simulate(
                    j.cfg, j.policy, stream, j.duration_s, _bar_updater(bar, tasks[j.key])
                )
            return out
        with Manager() as mgr:
            shared = mgr.dict()
            with ProcessPoolExecutor(max_workers=workers) as ex:
                futures = {j.key: ex.submit(_run_job, j, shared) for j in jobs}
                while not all(f.done() for f in futures.values()):
                    for key, t in list(shared.items()):
                        bar.update(tasks[key], completed=t)
                    time.sleep(0.2)
                return {k: f.result() for k, f in futures.items()}
