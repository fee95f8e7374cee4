"""New 220 KB documents encoded serially, in 2 threads, in 2 processes: which pool sizes faster.

The gateway sizes a new document's tokens in a sizing thread (``proxy.gateway.sizing_pool``).
This measures, on the machine it runs on, what a second thread or a process pool would buy:
cl100k encodes of distinct ~220 KB documents (``big_prompts_load.document``), wall time per
document, each pool warmed first (its tokenizers loaded). Threads encode with their own
copy of the encoding, as the sizing threads do.

    python -m loadtest.lab encode-pools --docs 16 --rounds 2
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

from loadtest.bench.big_prompts_load import document
from loadtest.bench.overhead_report import loadavg
from proxy.core.tokenizer import Counter, load_counter

_local = threading.local()


def count(text: str) -> int:
    """Tokens of ``text`` with this thread's (or process's) own cl100k counter."""
    counter: Counter | None = getattr(_local, "counter", None)
    if counter is None:
        counter = _local.counter = load_counter("cl100k_base", None)
    return counter.count(text)


def per_doc_ms(run: Callable[[list[str]], list[int]], docs: list[str]) -> float:
    started = time.perf_counter()
    run(docs)
    return 1000 * (time.perf_counter() - started) / len(docs)


def pooled(pool: Executor) -> Callable[[list[str]], list[int]]:
    list(pool.map(count, ["warm up"] * 8))
    return lambda docs: list(pool.map(count, docs))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.lab encode-pools", description=__doc__)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    docs = [document(5000 + i) for i in range(args.docs)]
    count("warm up")
    print(f"load average before: {loadavg()}")
    for _ in range(args.rounds):
        serial = per_doc_ms(lambda d: [count(x) for x in d], docs)
        with ThreadPoolExecutor(2) as threads:
            two_threads = per_doc_ms(pooled(threads), docs)
        with ProcessPoolExecutor(2) as procs:
            two_procs = per_doc_ms(pooled(procs), docs)
        print(
            f"ms per 220 KB document: serial {serial:.1f}, 2 threads {two_threads:.1f}, "
            f"2 processes {two_procs:.1f}"
        )
    print(f"load average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
