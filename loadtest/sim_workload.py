"""Request streams for the offline fleet simulator.

A six-day run is millions of requests, so mixes are generated lazily (an iterator, never a
list), seeded, and sorted by arrival by construction (Poisson arrivals). Trace replay reads
the Azure trace through ``loadtest.workload`` and loops it to cover any horizon.

Session retention: first-fit fragmentation only trends over *uptime* (rather than settling
within minutes) when some allocations live far longer than a request. Multi-turn chat
sessions whose KV stays resident between turns do exactly that; ``HoldModel`` gives a share
of requests a heavy-tailed (Pareto) extra holding time, which is what makes a node's
fragmentation creep up over days and what a restart resets.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol


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


class SimRequest(NamedTuple):
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One component of a mix: its share of requests and uniform prompt/output length ranges."""

    kind: str
    share: float
    prompt: tuple[int, int]
    output: tuple[int, int]


# The problem statement: 70% short chat queries under 500 tokens, 30% long documents 15k-30k.
PROBLEM_MIX: tuple[RequestClass, ...] = (
    RequestClass("short", 0.7, (40, 460), (30, 400)),
    RequestClass("long", 0.3, (15_000, 30_000), (200, 1_000)),
)


def parse_mix(text: str) -> tuple[RequestClass, ...]:
    """``kind:share:plo-phi:olo-ohi,...`` e.g. ``short:0.7:40-460:30-400,long:0.3:15000-30000:200-1000``."""
    out: list[RequestClass] = []
    for part in text.split(","):
        fields = part.strip().split(":")
        if len(fields) != 4:
            raise ValueError(f"mix component {part!r}: expected kind:share:plo-phi:olo-ohi")
        kind, share, p, o = fields
        try:
            plo, phi = (int(x) for x in p.split("-"))
            olo, ohi = (int(x) for x in o.split("-"))
            sh = float(share)
        except ValueError:
            raise ValueError(f"mix component {part!r}: share must be a number, ranges lo-hi integers") from None
        if sh <= 0 or not 0 < plo <= phi or not 0 < olo <= ohi:
            raise ValueError(f"mix component {part!r}: share must be > 0 and ranges 0 < lo <= hi")
        out.append(RequestClass(kind, sh, (plo, phi), (olo, ohi)))
    if not out:
        raise ValueError("empty mix")
    return tuple(out)


def mean_demand(mix: tuple[RequestClass, ...]) -> float:
    total = sum(c.share for c in mix)
    return sum(c.share / total * (sum(c.prompt) + sum(c.output)) / 2 for c in mix)


def mix_stream(mix: tuple[RequestClass, ...], rate_per_s: float, duration_s: float, seed: int) -> Iterator[SimRequest]:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s``, classes drawn by share."""
    if rate_per_s <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    total = sum(c.share for c in mix)
    cum: list[float] = []
    acc = 0.0
    for c in mix:
        acc += c.share / total
        cum.append(acc)
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s:
            return
        u = rng.random()
        c = mix[-1]
        for i, edge in enumerate(cum):
            if u < edge:
                c = mix[i]
                break
        (plo, phi), (olo, ohi) = c.prompt, c.output
        r = rng.random
        yield SimRequest(t, plo + int(r() * (phi - plo + 1)), olo + int(r() * (ohi - olo + 1)), c.kind)


def _read_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """(offset_s, prompt, output) rows; via loadtest.workload when present, else read here."""
    try:
        from loadtest.workload import load_trace

        reqs = load_trace(path, length_scale=1.0, rate_scale=1.0)
        return [(float(r.arrival_s), int(r.prompt_tokens), int(r.output_tokens)) for r in reqs]
    except ImportError:
        pass
    from datetime import datetime

    rows: list[tuple[float, int, int]] = []
    with open(path, newline="", encoding="ascii") as f:
        t0: datetime | None = None
        for rec in csv.DictReader(f):
            ts = datetime.strptime(rec["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            t0 = t0 or ts
            rows.append(((ts - t0).total_seconds(), int(rec["ContextTokens"]), int(rec["GeneratedTokens"])))
    return rows


def trace_stream(
    path: str | Path,
    duration_s: float,
    length_scale: float = 1.0,
    rate_scale: float = 1.0,
    long_threshold: int = 8_000,
) -> Iterator[SimRequest]:
    """Replay the trace, prompt lengths x ``length_scale``, arrivals x ``rate_scale`` faster,
    looped end to end until ``duration_s`` (the Azure code trace spans ~57 minutes)."""
    if length_scale <= 0 or rate_scale <= 0:
        raise ValueError("length_scale and rate_scale must be positive")
    rows = _read_trace(path)
    if not rows:
        return
    base = rows[0][0]
    span = (rows[-1][0] - base) / rate_scale + 1.0 / rate_scale
    loop = 0
    while True:
        offset = loop * span
        for t, p, o in rows:
            at = offset + (t - base) / rate_scale
            if at >= duration_s:
                return
            prompt = max(1, round(p * length_scale))
            kind = "long" if prompt + o >= long_threshold else "short"
            yield SimRequest(at, prompt, o, kind)
        loop += 1


def trace_rate(path: str | Path) -> tuple[float, float]:
    """(requests per second, mean demand in tokens) of the trace at scale 1."""
    rows = _read_trace(path)
    span = max(1e-9, rows[-1][0] - rows[0][0])
    return len(rows) / span, sum(p + o for _, p, o in rows) / len(rows)


@dataclass(frozen=True, slots=True)
class HoldModel:
    """A ``fraction`` of short requests keep their KV resident for a Pareto(``alpha``,
    ``min_s``) extra time, capped at ``max_s`` (sessions between turns, pinned prefixes)."""

    fraction: float = 0.0
    alpha: float = 1.1
    min_s: float = 60.0
    max_s: float = 7 * 86_400.0

    def sampler(self, seed: int) -> HoldSampler:
        return HoldSampler(self, seed)


class HoldSampler:
    __slots__ = ("_m", "_rng")

    def __init__(self, model: HoldModel, seed: int) -> None:
        self._m = model
        self._rng = random.Random(seed ^ 0x5EED)

    def extra(self, kind: str) -> float:
        m = self._m
        if m.fraction <= 0 or kind == "long" or self._rng.random() >= m.fraction:
            return 0.0
        u = 1.0 - self._rng.random()  # (0, 1]
        return min(m.max_s, m.min_s / math.pow(u, 1.0 / m.alpha))
