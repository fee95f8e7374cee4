"""Before/after, same run: the decision part of the overhead bench (issue 12) per variant.

- ``before``: v1's BLAKE2b block chain (one Python-level call per block) and tiktoken's ids
  as a Python list, then copied into an array (as until 2026-11-30);
- ``hash``: the vectorized hashes (``proxy.core.prefix``), ids still through a list;
- ``hash+ids``: and ids straight from tiktoken's buffer, never Python ints;
- ``after``: and the sizing worker threads at nice 10 (the code now);
- ``after+switch1ms``: and ``sys.setswitchinterval(0.001)`` (not adopted: no gain measured).

``python -m loadtest.bench.decision_ab --rounds 3``: two trivial backends, then per round
one ``decision_and_lag`` run per variant (the order rotates), the gateway in this
process. Prints each run and the median per variant of each number.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
from array import array
from collections.abc import Sequence
from typing import Any

import proxy.core.prefix_prompt as prefix_prompt
from loadtest.bench.overhead_decision import decision_and_lag
from loadtest.bench.overhead_targets import Bench
from proxy.core.prefix import block_hashes
from proxy.core.tokenizer import TiktokenCounter
from proxy.gateway import sizing

_ROOT = b"kvroute-prefix-v1"


def blake2b_block_hashes(
    token_ids: Sequence[int], block_tokens: int, max_blocks: int = 0
) -> list[int]:
    """v1's chain (the baseline): one keyed BLAKE2b call per block, the parent's digest as key."""
    n = len(token_ids) // block_tokens
    if max_blocks > 0:
        n = min(n, max_blocks)
    step = block_tokens * 8
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        raw = memoryview(token_ids).cast("B")
    else:
        raw = memoryview(array("q", token_ids[: n * block_tokens]).tobytes())
    parent = _ROOT
    out: list[int] = []
    for start in range(0, n * step, step):
        parent = hashlib.blake2b(raw[start : start + step], digest_size=8, key=parent).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def list_ids(self: TiktokenCounter, text: str) -> list[int]:
    """v1's ids: ``encode_ordinary``'s Python list (the ids cache copied it into an array)."""
    return self._enc.encode_ordinary(text) if text else []


def list_count(self: TiktokenCounter, text: str) -> int:
    return len(self._enc.encode_ordinary(text)) if text else 0


NOW = (block_hashes, TiktokenCounter.ids, TiktokenCounter.count, sizing.WORKER_NICE, 0.005)
VARIANTS: dict[str, tuple[Any, Any, Any, int, float]] = {
    "before": (blake2b_block_hashes, list_ids, list_count, 0, 0.005),
    "hash": (block_hashes, list_ids, list_count, 0, 0.005),
    "hash+ids": (*NOW[:3], 0, 0.005),
    "after": NOW,
    "after+switch1ms": (*NOW[:4], 0.001),
}
_nice = [0]
_size = sizing._size


def niced_size(*args: Any) -> Any:
    # Worker threads only (inline sizing runs on the loop's thread, which stays at 0); after
    # the gateway's own lowering (``sizing._size_in_worker``), so this variant's nice holds.
    if threading.current_thread() is not threading.main_thread():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _nice[0])
    return _size(*args)


def use(variant: tuple[Any, Any, Any, int, float]) -> None:
    # The gateway runs in this process: its hashing and its tokenizer are these.
    prefix_prompt.block_hashes = variant[0]  # type: ignore[attr-defined]
    TiktokenCounter.ids = variant[1]  # type: ignore[method-assign]
    TiktokenCounter.count = variant[2]  # type: ignore[method-assign]
    _nice[0] = variant[3]
    sys.setswitchinterval(variant[4])
    sizing._size = niced_size  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--long-requests", type=int, default=5)
    a = p.parse_args(argv)
    bench = Bench(argparse.Namespace(backends=2, stream_chunks=4, policy="kvroute"))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in VARIANTS}
    try:
        bench.start_backends()
        cfg = bench.gateway_config_path("decision", False)
        for r in range(a.rounds):
            names = list(VARIANTS)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                use(VARIANTS[name])
                got = decision_and_lag(cfg, n_long=a.long_requests, mix_n=7 * a.long_requests)
                runs[name].append(got)
                print(name, json.dumps(got), flush=True)
    finally:
        use(NOW)
        sizing._size = _size
        bench.stop_all()
    keys = [k for k in runs["after"][0] if k.startswith(("decision", "loop", "idle"))]
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
