"""Before/after, same run: the decision part of the overhead bench with v1's BLAKE2b block chain
and with the vectorized hashes (``proxy.core.prefix``), in alternating rounds.

``python -m loadtest.bench.decision_ab --rounds 3``: two trivial backends, then per round
one ``decision_and_lag`` run per variant (the order alternates), the gateway in this
process. Prints each run and the median per variant of each number.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import proxy.core.prefix_prompt as prefix_prompt
from loadtest.bench.overhead_decision import decision_and_lag
from loadtest.bench.overhead_targets import Bench
from proxy.core.prefix import block_hashes

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


VARIANTS = {"blake2b-chain": blake2b_block_hashes, "numpy": block_hashes}


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
            names = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                prefix_prompt.block_hashes = VARIANTS[name]  # type: ignore[assignment]
                got = decision_and_lag(cfg, n_long=a.long_requests, mix_n=7 * a.long_requests)
                runs[name].append(got)
                print(name, json.dumps(got), flush=True)
    finally:
        prefix_prompt.block_hashes = block_hashes
        bench.stop_all()
    keys = [k for k in runs["numpy"][0] if k.startswith(("decision", "loop", "idle"))]
    print("median of rounds:")
    for name, rs in runs.items():
        print(f"  {name:14s}", {k: round(statistics.median(x[k] for x in rs), 2) for k in keys})
    return 0


if __name__ == "__main__":
    sys.exit(main())
