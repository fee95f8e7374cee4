"""The do-no-harm grid: its cells (each bound by one thing), the two engine models, the workload.

Sizes are in *simulated* tokens and seconds; the engines run ``--speedup`` times faster than
simulated time, so a cell's arrivals per wall second are its simulated rate times the
speedup. The rates were set from each cell's binding resource (4 engines, prefill 10,000
tokens/s, decode 30 tokens/s per request, mean sizes below):

* ``prefill``: documents 15k-30k, short outputs: 4.9 arrivals/s carry 0.85 of the fleet's
  40,000 prompt tokens/s; nothing else is near its limit;
* ``decode``: long outputs (documents 2k-4k writing 600-1,200 tokens): ~30 requests decoding
  at once, a few percent of the prefill rate;
* ``slots``: 4 running requests per engine (16 in all) of ~5 s each: 2.9 arrivals/s fill 0.9
  of them, the rest wait in the engines' queues;
* ``memory``: 40,000 KV tokens per engine, documents 6k-12k writing 300-600 tokens: the KV
  in flight (~32,000 tokens per engine at 3 arrivals/s) leaves little room as outputs grow,
  so a placement that piles documents up preempts (at 4 arrivals/s every router thrashed
  on the v1 model: over a thousand preemptions, TTFT p99 of 30-60 wall seconds);
* ``overload``: the prefill cell at 1.25x the fleet's prefill rate: queues grow all run;
* ``smoke``: a tiny cell for the test (a few requests, nothing binds).

The two engine models (``docs/engine.md``): ``classic`` configured as issue 53's independent
engine (one prefill at a time at 10,000 tokens/s, 30 tokens/s per running request whatever
the batch, FIFO, lazily allocated blocks, preemption by recompute, 256 running requests,
one SSE event per token flushed every 50 ms), and ``v1`` (vLLM v1's scheduler: a token
budget of 8,192 per step, chunked prefill, steps of 30 ms + 0.1 ms per scheduled token).
Every request writes exactly its ``max_tokens`` (no end-of-sequence marker).
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.bench.engine_fleet import engine_flags
from loadtest.workload import Request, bimodal

Range = tuple[int, int]

#: Prefill tokens per simulated second, both models (v1: the per-token step cost is 1/this).
PREFILL_TOKENS_PER_S = 10_000.0
MODELS = ("classic", "v1")


@dataclass(frozen=True, slots=True)
class Cell:
    """One cell of the grid: what binds, the engines' limits, the workload's shape and rate."""

    name: str
    binds: str
    rate: float  # arrivals per simulated second
    long: Range  # documents' prompt tokens
    short_output: Range
    long_output: Range
    capacity: int = 200_000  # KV tokens per engine
    max_num_seqs: int = 256
    short: Range = (20, 500)

    @property
    def memory_bound(self) -> bool:
        return self.binds == "memory"

    @property
    def overloaded(self) -> bool:
        return self.binds == "overload"


CELLS: dict[str, Cell] = {
    c.name: c
    for c in (
        Cell("prefill", "prefill", 4.9, (15_000, 30_000), (16, 64), (16, 64)),
        Cell("decode", "decode", 1.5, (2_000, 4_000), (200, 600), (600, 1_200)),
        Cell("slots", "slots", 2.9, (1_000, 3_000), (50, 200), (100, 300), max_num_seqs=4),
        Cell("memory", "memory", 3.0, (6_000, 12_000), (50, 200), (300, 600), capacity=40_000),
        Cell("overload", "overload", 7.2, (15_000, 30_000), (16, 64), (16, 64)),
        Cell("smoke", "nothing", 1.0, (1_000, 2_000), (8, 16), (8, 16), capacity=20_000),
    )
}
DEFAULT_CELLS = ("prefill", "decode", "slots", "memory", "overload")


def model_extra_flags(model: str) -> list[str]:
    """What makes an engine ``model`` (``classic`` or ``v1``), beyond its sizes and rates."""
    if model == "classic":
        flags = ["--serial-prefill", "--no-prefix-caching", "--stream-interval", "1"]
        return [*flags, "--flush-interval-s", "0.05"]
    if model == "v1":
        return ["--scheduler", "v1", "--step-base-ms", "30", "--max-num-batched-tokens", "8192"]
    raise ValueError(f"engine model must be one of {', '.join(MODELS)}, got {model!r}")


def model_flags(model: str, cell: Cell, speedup: float) -> list[str]:
    """The flags of one engine of ``model`` in ``cell``."""
    extra = model_extra_flags(model)
    return engine_flags(cell.capacity, PREFILL_TOKENS_PER_S, speedup, cell.max_num_seqs, *extra)


def workload(cell: Cell, duration_s: float, speedup: float, seed: int) -> list[Request]:
    """70% chats, 30% documents, open loop: ``duration_s`` wall seconds of arrivals."""
    return bimodal(
        cell.rate * speedup,
        duration_s=duration_s,
        seed=seed,
        short=cell.short,
        long=cell.long,
        short_output=cell.short_output,
        long_output=cell.long_output,
    )
