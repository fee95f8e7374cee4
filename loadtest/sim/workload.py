"""Request streams for the offline fleet simulator.

A six-day run is millions of requests, so mixes are generated lazily (an iterator, never a
list) through ``loadtest.workload`` (the generator the benchmarks use too), seeded and sorted
by arrival. Trace replay loops the trace end to end to cover any horizon.

Session retention: first-fit fragmentation only trends over *uptime* (rather than settling
within minutes) when some allocations live far longer than a request. Multi-turn chat
sessions whose KV stays resident between turns do exactly that; ``HoldModel`` gives a share
of chat-sized requests a heavy-tailed (Pareto) extra holding time, which is what makes a node's
fragmentation creep up over days and what a restart resets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loadtest.workload import (
    DEFAULT_LONG_THRESHOLD,
    MixClass,
    Request,
    bimodal_classes,
    iter_parametric,
    load_trace,
)


class ReqLike(Protocol):
    """What the simulator reads from a request (``loadtest.workload.Request`` satisfies it)."""

    @property
    def arrival_s(self) -> float: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def kind(self) -> str: ...


def problem_mix() -> list[MixClass]:
    """The problem statement: 70% short chat queries under 500 tokens, 30% long documents 15k-30k."""
    return bimodal_classes()


def parse_mix(text: str) -> list[MixClass]:
    """``kind:share:plo-phi:olo-ohi,...`` e.g. ``short:0.7:20-500:16-256,long:0.3:15000-30000:128-1024``."""
    out: list[MixClass] = []
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) != 4 or fields[0] not in ("short", "long"):
            raise ValueError(f"mix component {part!r}: expected short|long:share:plo-phi:olo-ohi")
        kind, share, p, o = fields
        try:
            plo, phi = (int(x) for x in p.split("-"))
            olo, ohi = (int(x) for x in o.split("-"))
            sh = float(share)
        except ValueError:
            raise ValueError(
                f"mix component {part!r}: share must be a number, ranges lo-hi integers"
            ) from None
        if sh <= 0 or not 0 < plo <= phi or not 0 < olo <= ohi:
            raise ValueError(f"mix component {part!r}: share must be > 0 and ranges 0 < lo <= hi")
        out.append(MixClass("long" if kind == "long" else "short", sh, (plo, phi), (olo, ohi)))
    return out


def mean_demand(mix: Sequence[MixClass]) -> float:
    """Mean KV demand (prompt + output tokens) of a request drawn from ``mix``."""
    total = sum(c.share for c in mix)
    return sum(c.share / total * (sum(c.prompt) + sum(c.output)) / 2 for c in mix)


def mix_stream(
    mix: Sequence[MixClass], rate_per_s: float, duration_s: float, seed: int
) -> Iterator[Request]:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s`` (lazy: six days never sit in memory)."""
    return iter_parametric(rate_per_s, mix, duration_s=duration_s, seed=seed)


def trace_stream(
    path: str | Path,
    duration_s: float,
    length_scale: float = 1.0,
    rate_scale: float = 1.0,
    long_threshold: int = DEFAULT_LONG_THRESHOLD,
) -> Iterator[Request]:
    """Replay the trace, prompt lengths x ``length_scale``, arrivals x ``rate_scale`` faster,
    looped end to end until ``duration_s`` (the Azure code trace spans ~57 minutes)."""
    rows = load_trace(path, length_scale, rate_scale, long_threshold=long_threshold)
    if not rows:
        return
    gap = (rows[-1].arrival_s - rows[0].arrival_s) / max(1, len(rows) - 1)
    span = rows[-1].arrival_s + gap
    loop = 0
    while True:
        offset = loop * span
        for r in rows:
            at = offset + r.arrival_s
            if at >= duration_s:
                return
            yield Request(at, r.prompt_tokens, r.output_tokens, r.kind)
        loop += 1


def trace_stats(
    path: str | Path, length_scale: float = 1.0, rate_scale: float = 1.0
) -> tuple[float, float]:
    """(requests per second, mean demand in tokens) of the trace at these scales."""
    rows = load_trace(path, length_scale, rate_scale)
    span = max(1e-9, rows[-1].arrival_s - rows[0].arrival_s)
    return len(rows) / span, sum(r.total_tokens for r in rows) / len(rows)


@dataclass(frozen=True, slots=True)
class HoldModel:
    """A ``fraction`` of chat-sized requests (demand up to ``max_tokens``) keep their KV
    resident for a Pareto(``alpha``, ``min_s``) extra time, capped at ``max_s`` (sessions
    between turns, pinned prefixes). Documents are never retained."""

    fraction: float = 0.0
    alpha: float = 1.1
    min_s: float = 60.0
    max_s: float = 7 * 86_400.0
    max_tokens: int = 1_000

    def sampler(self, seed: int) -> HoldSampler:
        return HoldSampler(self, seed)


class HoldSampler:
    __slots__ = ("_m", "_rng")

    def __init__(self, model: HoldModel, seed: int) -> None:
        self._m = model
        self._rng = random.Random(seed ^ 0x5EED)

    def extra(self, demand: int) -> float:
        m = self._m
        if m.fraction <= 0 or demand > m.max_tokens or self._rng.random() >= m.fraction:
            return 0.0
        u = 1.0 - self._rng.random()  # (0, 1]
        return min(m.max_s, m.min_s / math.pow(u, 1.0 / m.alpha))
