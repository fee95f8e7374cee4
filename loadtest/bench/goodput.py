"""Goodput of a fixed request list, and the floor no router can beat.

The memory-pressure benchmark sends the same requests to every router, and every router
finishes every one of them. Its goodput as the issue defines it (output tokens of completed
requests per second of the run, first arrival to last answer) then divides one total by
the time of the *last* answer, and that time is one request's arrival + wait + prefill +
decode. Which request is last is set by the workload (the one that writes the most, late),
and routers differ there only by that request's time to first token; a router cannot tell
it from the others (every request asks the same ``max_tokens``).

So the report adds two figures that count every request's completion:

* **the floor**: the earliest any router could answer the last token, each request started
  on arrival on an idle engine (prompt at the prefill rate, output at the decode rate);
  ``total / floor`` bounds every router's goodput;
* **goodput by the floor**: output tokens of the requests completed by that moment, per
  second: work finished early counts, work held counts later;
* **the token-weighted mean end**: when an output token's request completed, averaged over
  tokens (lower is better).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.workload import Request


@dataclass(frozen=True, slots=True)
class Finish:
    """One completed request: when its last token came (seconds since the first arrival)."""

    end_s: float
    tokens: int


def floor(requests: Sequence[Request], prefill_tps: float, decode_tps: float) -> tuple[float, int]:
    """The earliest possible last answer, and the index of the request that sets it.

    Each request alone on an engine: its prompt at ``prefill_tps``, which also gives the first
    token, then one token every ``1 / decode_tps`` s. Queues, waits and transfers only add.
    """
    if not requests:
        raise ValueError("no requests")
    ends = [
        r.arrival_s + r.prompt_tokens / prefill_tps + max(0, r.output_tokens - 1) / decode_tps
        for r in requests
    ]
    last = max(range(len(ends)), key=ends.__getitem__)
    return ends[last], last


def done_by(finishes: Sequence[Finish], t: float) -> int:
    """Output tokens of the requests completed by ``t``."""
    return sum(f.tokens for f in finishes if f.end_s <= t)


def mean_end(finishes: Sequence[Finish]) -> float | None:
    """When an output token's request completed, averaged over all output tokens."""
    total = sum(f.tokens for f in finishes)
    if total == 0:
        return None
    return sum(f.end_s * f.tokens for f in finishes) / total
