"""The memory-pressure benchmark's workloads: who asks for what, when, on how much KV.

Clients ask for more output than they use, as real ones do: each class of request sends one
fixed ``max_tokens`` and the simulated model stops at its own length (the prompt's
``[eos:N]`` marker, ``loadtest.engine.behaviours.eos``).

* ``bimodal-low`` / ``bimodal-high``: 70% short chats, 30% documents with long answers, at
  two arrival rates, 10k tokens per engine;
* ``trace``: the shipped Azure code trace, outputs x8 (up to 2,000), 8 req/s, 10k tokens per
  engine: long answers, KV growing through decode, at a small scale;
* ``trace-x4``: the same trace at the scale users first reported: lengths x4 (prompts and
  outputs), 24 req/s, 60k tokens per engine (``--trace-x4-*``).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.engine.behaviours.eos import marker
from loadtest.workload import Kind, Request, bimodal, chat_overhead_tokens, load_trace, make_prompt

WORKLOADS = ("bimodal-low", "bimodal-high", "trace", "trace-x4")
TRACE = Path(__file__).resolve().parent.parent / "data" / "AzureLLMInferenceTrace_code.csv"


@dataclass
class Workload:
    name: str
    requests: list[Request]
    # The max_tokens each client class sends (its answers are shorter: the [eos:N] marker).
    caps: dict[str, int]
    capacity: int  # KV tokens per engine
    long_min: int  # smallest long prompt

    @property
    def long_threshold(self) -> int:
        """The gateway's long threshold: the smallest long prompt plus the short class's
        ``max_tokens``, so the gateway classes requests as this workload does.

        The threshold counts demand (prompt + ``max_tokens``). Set at half the smallest long
        prompt, as it was, every ``trace`` request (``max_tokens`` 2,048 against 2,000) was
        long: the two long-pool engines took the whole trace first and short requests got
        no protection.
        """
        return self.long_min + self.caps["short"]


def add_options(p: argparse.ArgumentParser) -> None:
    """The workloads' own knobs (sizes, rates, scales)."""
    p.add_argument("--capacity", type=int, default=10_000, help="KV tokens per engine (bimodal)")
    p.add_argument(
        "--trace-capacity", type=int, default=10_000, help="KV tokens per engine (trace)"
    )
    p.add_argument("--rate-low", type=float, default=6.0, help="arrivals/s, bimodal-low")
    p.add_argument("--rate-high", type=float, default=9.0, help="arrivals/s, bimodal-high")
    p.add_argument("--trace-rate", type=float, default=8.0, help="arrivals/s, trace")
    p.add_argument("--trace-output-scale", type=float, default=8.0)
    p.add_argument("--trace-x4-capacity", type=int, default=60_000, help="KV tokens per engine")
    p.add_argument("--trace-x4-rate", type=float, default=24.0, help="arrivals/s, trace-x4")
    p.add_argument("--trace-x4-scale", type=float, default=4.0, help="prompts and outputs x")
    p.add_argument(
        "--trace-x4-duration",
        type=float,
        default=6.0,
        help="seconds of arrivals, trace-x4 (never above --duration)",
    )


def trace_requests(
    scale: float, output_scale: float, rate: float, duration: float, long_min: int, seed: int
) -> list[Request]:
    """A window of the shipped trace, arrivals re-spaced to ``rate`` (its own is ~2.6/s)."""
    reqs = load_trace(TRACE, length_scale=scale, output_scale=output_scale, rate_scale=1.0)
    rng = random.Random(seed)
    t, out = 0.0, []
    start = rng.randrange(0, max(1, len(reqs) - 10_000))
    for r in reqs[start:]:
        t += rng.expovariate(rate)
        if t > duration:
            break
        kind: Kind = "long" if r.prompt_tokens >= long_min else "short"
        out.append(Request(t, r.prompt_tokens, min(r.output_tokens, 2_000), kind))
    return out


def workload(name: str, args: argparse.Namespace, seed: int) -> Workload:
    """The request list of one workload (the same for every router of a run)."""
    if name == "trace":
        reqs = trace_requests(
            1.0, args.trace_output_scale, args.trace_rate, args.duration, 4_000, seed
        )
        return Workload(name, reqs, {"short": 2_048, "long": 2_048}, args.trace_capacity, 4_000)
    if name == "trace-x4":
        scale = args.trace_x4_scale
        long_min = round(4_000 * scale)
        duration = min(args.duration, args.trace_x4_duration)
        reqs = trace_requests(scale, scale, args.trace_x4_rate, duration, long_min, seed)
        caps = {"short": 2_048, "long": 2_048}
        return Workload(name, reqs, caps, args.trace_x4_capacity, long_min)
    if name not in ("bimodal-low", "bimodal-high"):
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    rate = args.rate_low if name == "bimodal-low" else args.rate_high
    reqs = bimodal(
        rate,
        duration_s=args.duration,
        seed=seed,
        short=(20, 300),
        long=(3_000, 6_000),
        short_output=(16, 256),
        long_output=(200, 1_000),
    )
    return Workload(name, reqs, {"short": 512, "long": 1_024}, args.capacity, 3_000)


def bodies(w: Workload, seed: int) -> list[dict[str, Any]]:
    """One streamed chat body per request: its prompt, its real length's marker, its class's cap."""
    rng = random.Random(seed)
    overhead = chat_overhead_tokens()
    out = []
    for r in w.requests:
        # Within the engine's context (prompt + max_tokens), never below the real output.
        room = w.capacity - r.prompt_tokens - 64
        cap = max(min(w.caps[r.kind], room), r.output_tokens)
        text = make_prompt(max(1, r.prompt_tokens - overhead - 4), rng) + marker(r.output_tokens)
        out.append(
            {
                "model": "sim-model",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": cap,
                "stream": True,
            }
        )
    return out
