"""Forward projection of a paged engine's KV use: the peak that in-flight work will reach.

A lazily allocating engine (vLLM, SGLang) holds a request's prompt blocks at admission and
one more block every ``block_size`` decoded tokens. When a decode step finds no free block
it preempts a running request and later recomputes it: GPU time wasted, a stall the user
sees. Counting every in-flight request at ``prompt + max_tokens`` (``proxy.core.lazy``)
avoids that but wastes the cache: clients ask for far more output than they use (a chat's
``max_tokens`` of 1024 for a 150-token answer). Here each request counts at its *expected*
output, learned per model (and per client key) as a distribution of actual / ``max_tokens``,
and the node's load counts at its projected **peak**, not the sum of peaks: requests that
finish early free their blocks before the longest ones grow to their end.

Peak, with every running request decoding one token per step (same rate): sort by tokens
still to come, ``r_1 >= r_2 >= ... >= r_n``. Just before request ``k`` ends (after ``r_k``
more steps) the requests still live are ``1..k``, each holding its tokens now plus ``r_k``:

    peak = max over k of  sum(now_i for i <= k) + k * r_k       (+ a block per request)

Pure: no I/O, no clock. The gateway (``proxy.gateway.pressure``) feeds it; the simulator can.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Flight:
    """One in-flight request on one node, as the gateway knows it."""

    prompt_tokens: int
    max_tokens: int
    expected_output: int
    generated: int = 0
    # Data-parallel servers: the engine the gateway pinned it to (``X-data-parallel-rank``);
    # None where the server's front end chose (the gateway does not know which).
    engine: int | None = None

    @property
    def now_tokens(self) -> int:
        """Tokens it holds (or will once prefilled): prompt plus what it has written."""
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens still expected. Past its expected length it is a long one: ``max_tokens`` bounds it.

        A request that outgrew its expectation keeps growing at most to ``max_tokens``; it is
        counted one more expected length on (doubling, bounded), not at once at its worst case.
        """
        if self.generated < self.expected_output:
            return self.expected_output - self.generated
        return min(self.max_tokens, 2 * max(1, self.generated)) - self.generated


def projected_peak(flights: Iterable[Flight], block_size: int = 1) -> int:
    """Tokens the flights will hold at their joint peak (whole blocks: one block slack each)."""
    ordered = sorted(flights, key=lambda f: f.remaining, reverse=True)
    slack = max(0, block_size - 1)
    held = 0
    peak = 0
    for k, f in enumerate(ordered, start=1):
        held += f.now_tokens + slack
        peak = max(peak, held + k * f.remaining)
    return peak


def busiest_engine_peak(engine_used: Sequence[int], now_tokens: int, peak: int) -> int:
    """The projected peak of a data-parallel node's busiest engine, from its flights' peak.

    The server's front end places each request on an engine by queue length, not by KV, so
    the gateway does not know which engine holds which flight. Splitting the flights' peak
    evenly over the engines is wrong exactly when it matters: a few long documents on one
    engine and many short chats on the other leave the first engine nearly full and the
    split at half (measured: an engine at 94% of its KV while the split said 60%, then
    preemptions there). The engines' reported usage shows where the work sits, so the
    flights' growth still to come (``peak - now_tokens``) is attributed in proportion to
    what each engine holds now; the busiest engine's ``used + its share`` is the node's
    peak per engine, never below the even split.
    """
    engines = max(1, len(engine_used))
    even = math.ceil(peak / engines)
    total = sum(max(0, u) for u in engine_used)
    if total <= 0:
        return even
    growth = max(0, peak - now_tokens)
    busiest = max(math.ceil(u + growth * u / total) for u in engine_used if u > 0)
    return max(even, busiest)


@dataclass(frozen=True, slots=True)
class EngineChoice:
    """The engine of a data-parallel server a new request is pinned to, and its KV there."""

    engine: int
    # Tokens spoken for on that engine at its projected peak with the new request (plus
    # ``extra``): what ``lazy_headroom`` weighs against the engine's capacity.
    committed: int


def choose_engine(
    flights: Iterable[Flight],
    new: Flight,
    engine_used: Sequence[int],
    engine_capacity: int,
    block_size: int = 1,
    extra: float = 0.0,
) -> EngineChoice:
    """The engine where ``new`` leaves the most room at the projected peak.

    Where the gateway pins each request's engine (vLLM and SGLang honour the
    ``X-data-parallel-rank`` header), each engine's flights are known, and its peak is
    projected from its own flights, not from a share of the node's: the split by reported
    usage (``busiest_engine_peak``) was a guess that let one engine grow into a preemption
    while the other stood idle (docs/benchmarks.md, section 12). A flight whose engine is
    not known (placed while the server chose) counts on every engine. The engine's usage
    that its flights do not explain (another client, work ended since the report) is added
    to the peak. Room is what the engine's capacity leaves above the larger of its usage now
    plus the new prompt and that peak; ties go to the engine with fewer flights, then the
    lower rank.
    """
    per_engine: list[list[Flight]] = [[] for _ in engine_used]
    for f in flights:
        if f.engine is not None and 0 <= f.engine < len(per_engine):
            per_engine[f.engine].append(f)
        else:
            for group in per_engine:
                group.append(f)
    best: tuple[float, int, int] | None = None
    choice = EngineChoice(0, 0)
    for e, (group, used) in enumerate(zip(per_engine, engine_used, strict=True)):
        # Usage the engine's flights do not explain stays under the peak.
        unexplained = max(0, used - sum(f.now_tokens for f in group))
        committed = math.ceil(projected_peak([*group, new], block_size) + extra + unexplained)
        room = engine_capacity - max(used + new.now_tokens, committed)
        key = (-room, len(group), e)
        if best is None or key < best:
            best = key
            choice = EngineChoice(e, committed)
    return choice


def tokens_freed_within(flights: Iterable[Flight], steps: float) -> int:
    """Tokens released by the flights that end within ``steps`` decode steps (for hold bounds)."""
    return sum(f.now_tokens + f.remaining for f in flights if f.remaining <= steps)


def steps_until_free(flights: Iterable[Flight], deficit: int) -> float:
    """Decode steps until the flights that end free at least ``deficit`` tokens (inf: never)."""
    if deficit <= 0:
        return 0.0
    freed = 0
    for f in sorted(flights, key=lambda f: f.remaining):
        freed += f.now_tokens + f.remaining
        if freed >= deficit:
            return float(f.remaining)
    return math.inf


@dataclass
class OutputRatios:
    """What fraction of ``max_tokens`` requests really write, per key, over a bounded window.

    The expected output is a high quantile of the ratio times ``max_tokens``: a projection
    that is wrong for a few requests costs a few preemptions, one wrong for the median costs
    many. Too few samples: ``max_tokens`` itself (the worst case, as without projection).
    """

    quantile: float = 0.9
    min_samples: int = 20
    window: int = 500
    _ratios: dict[str, deque[float]] = field(default_factory=dict)
    # The same window kept sorted: the quantile is one index, whatever the traffic. (It was
    # a sort of the window on the first request after each sample, and every answer is a
    # sample: one sort per key per request. Measured on tiny requests at c=64: ~1% of req/s.)
    _sorted: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, key: str, output_tokens: int, max_tokens: int) -> None:
        if max_tokens <= 0:
            return
        ratios = self._ratios.get(key)
        if ratios is None:
            ratios = self._ratios[key] = deque(maxlen=max(1, self.window))
            self._sorted[key] = []
        ordered = self._sorted[key]
        if len(ratios) == ratios.maxlen:
            del ordered[bisect_left(ordered, ratios[0])]
        value = min(1.0, max(0.0, output_tokens / max_tokens))
        ratios.append(value)
        insort(ordered, value)

    def ratio(self, key: str) -> float | None:
        """The learned ratio for ``key``; None below ``min_samples``."""
        ordered = self._sorted.get(key)
        if ordered is None or len(ordered) < self.min_samples:
            return None
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]

    def samples(self, key: str) -> int:
        ratios = self._ratios.get(key)
        return len(ratios) if ratios is not None else 0

    def expected(self, keys: Iterable[str], max_tokens: int) -> int:
        """Expected output: the first key with enough samples (client, then model), else max."""
        for key in keys:
            r = self.ratio(key)
            if r is not None:
                return max(1, min(max_tokens, math.ceil(r * max_tokens)))
        return max_tokens

    def keys(self) -> list[str]:
        return sorted(self._ratios)
