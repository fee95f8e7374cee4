"""Goodput of a fixed request list, and the floor no router can beat.

The memory-pressure benchmark sends the same requests to every router, and every router
finishes every one of them. Its goodput as the issue defines it (output tokens of completed
requests per second of the run, first arrival to last answer) then divides one total by
the time of the *last* answer, and that time is one request's arrival + wait + prefill +
decode. Which request is last is set by the workload (the one that writes the most, late),
and routers differ there only by that request's time to first token; a router cannot tell
it from the others (every request asks the same ``max_tokens``).

So the report adds:

* **the floor**: the earliest any router could answer the last token, each request started
  on arrival on an idle engine (prompt at the prefill rate, output at the decode rate);
  ``total / floor`` is the ceiling of every router's goodput, and the TTFT of the request
  that sets it shows what a router's goodput was decided by;
* **the token-weighted mean end**: when an output token's request completed, averaged over
  all output tokens (lower is better). It counts every request's completion, not only the
  last one: work finished early lowers it, work held raises it. (Tokens completed by a
  fixed moment were tried too: one long answer on either side of the moment moved them by
  10%.)

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


def mean_end(finishes: Sequence[Finish]) -> float | None:
    """When an output token's request completed, averaged over all output tokens."""
    total = sum(f.tokens for f in finishes)
    if total == 0:
        return None
    return sum(f.end_s * f.tokens for f in finishes) / total
