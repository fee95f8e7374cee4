"""Before/after, same run: the decision part of the overhead bench (issue 12) per variant.

Sizing-thread variants (``proxy.gateway.sizing_pool``):

- ``before``: the loop's default executor (up to 6 threads here) at nice 10, every thread
  sharing one tiktoken encoding (the code until 2026-11-30, late);
- ``pool2-shared``: two sizing threads of their own at nice 10, the shared encoding;
- ``pool2``: two sizing threads, each encoding with its own copy;
- ``pool2-split``: and a big text encoded as two halves at once when the other thread is
  free (``sizing.threads: 2``);
- ``pool1``: one sizing thread with its own copy (the default now, ``sizing.threads: 1``);
- ``pool2-idle``, ``pool1-idle``: ``pool2-split``, ``pool1`` with the threads at
  SCHED_IDLE instead of nice 10; ``pool1-nice19``: ``pool1`` at nice 19.

``python -m loadtest.bench.decision_ab --rounds 3``: two trivial backends, then per round
one ``decision_and_lag`` run per variant (the order rotates), the gateway in this
process. Prints each run and the median per variant of each number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from loadtest.bench.overhead_decision import decision_and_lag
from loadtest.bench.overhead_targets import Bench
from proxy.core.tokenizer import own_encodings
from proxy.gateway import sizing_pool

_run, _configure = sizing_pool.run, sizing_pool.configure
_threads, _idle, _split = sizing_pool.THREADS, sizing_pool.SCHED_IDLE, sizing_pool.SPLIT
_nice = sizing_pool.WORKER_NICE


async def default_executor_run(fn: Callable[..., Any], *args: Any) -> Any:
    """The old hop: ``asyncio.to_thread``, the thread lowered on its first big request."""

    def lowered() -> Any:
        sizing_pool.lower_this_thread()
        return fn(*args)

    return await asyncio.to_thread(lowered)


def _keep(threads: int) -> None:
    """The variant's number of threads stays."""


def _no_copies() -> None:
    """Sizing threads share the process's one encoding (as before)."""


# name -> (threads, SCHED_IDLE, own encodings, split, the hop, nice)
Variant = tuple[int, bool, bool, bool, Any, int]
VARIANTS: dict[str, Variant] = {
    "before": (1, False, False, False, default_executor_run, sizing_pool.WORKER_NICE),
    "pool2-shared": (2, False, False, False, _run, sizing_pool.WORKER_NICE),
    "pool2": (2, False, True, False, _run, sizing_pool.WORKER_NICE),
    "pool2-split": (2, False, True, True, _run, sizing_pool.WORKER_NICE),
    "pool1": (1, False, True, False, _run, sizing_pool.WORKER_NICE),
    "pool2-idle": (2, True, True, True, _run, sizing_pool.WORKER_NICE),
    "pool1-idle": (1, True, True, False, _run, sizing_pool.WORKER_NICE),
    "pool1-nice19": (1, False, True, False, _run, 19),
}


def use(variant: Variant) -> None:
    # The gateway runs in this process: its sizing threads are these.
    threads, idle, own, split, hop, nice = variant
    sizing_pool.reset()
    sizing_pool.THREADS = threads
    sizing_pool.SCHED_IDLE = idle
    sizing_pool.SPLIT = split
    sizing_pool.WORKER_NICE = nice
    sizing_pool.own_encodings = own_encodings if own else _no_copies  # type: ignore[attr-defined]
    sizing_pool.run = hop
    # The gateway's config (``sizing.threads``) would set its own number.
    sizing_pool.configure = _keep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--long-requests", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    a = p.parse_args(argv)
    chosen = [v for v in a.variants.split(",") if v]
    bench = Bench(argparse.Namespace(backends=2, stream_chunks=4, policy="kvroute"))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in chosen}
    try:
        bench.start_backends()
        cfg = bench.gateway_config_path("decision", False)
        for r in range(a.rounds):
            names = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
            for name in names:
                use(VARIANTS[name])
                got = decision_and_lag(cfg, n_long=a.long_requests, mix_n=7 * a.long_requests)
                runs[name].append(got)
                print(name, json.dumps(got), flush=True)
    finally:
        use((_threads, _idle, True, _split, _run, _nice))
        sizing_pool.configure = _configure
        bench.stop_all()
    keys = [k for k in runs[chosen[0]][0] if k.startswith(("decision", "sizing", "loop", "idle"))]
    print("median of rounds:")
    for name, rs in runs.items():
        print(f"  {name:14s}", {k: round(statistics.median(x[k] for x in rs), 2) for k in keys})
    print("each round's loop lag p99 / decision p50 alone (ms):")
    for name, rs in runs.items():
        lags = [x["loop_lag_ms_p99"] for x in rs]
        dec = [x["decision_ms_p50_alone"] for x in rs]
        print(f"  {name:14s} {lags} / {dec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
