"""The few worker threads big requests are sized in: lowered, each with its own tokenizer.

Why not the loop's default executor (as until 2026-11-30):

- **The tokenizer is faster in a thread of its own.** tiktoken's regex (the ``regex``
  crate) keeps its matching caches in a pool that serves the first thread ever to use it
  on a fast path and every other thread through a slower shared path: a 30k-token encode
  cost 6.7 ms of CPU in any thread but the first, 4.6 ms in the first (same text, same
  run). Each sizing thread therefore encodes with its own copy of the encoding
  (``proxy.core.tokenizer.own_encodings``; ~21 MB and ~0.14 s to build per thread and
  encoding, done at startup by ``warm``).
- **Few threads, lowered.** The event loop lags when it waits for a core behind encodes
  (issue 12); a small pool bounds how many run at once, and each thread runs at
  ``WORKER_NICE`` (Linux, per thread) so the loop's thread gets a core first. One thread
  by default (``sizing.threads``): it sizes ~200 fresh 30k-token prompts a second (~6M
  prompt tokens/s, more than dozens of engines prefill), and on 2 shared cores it kept the
  loop's lag p99 at about half of two threads' (docs/benchmarks.md). Nice 19 and
  SCHED_IDLE lowered the lag a little more but made the decision slower and less steady
  on a busy box (a thread that waits behind every other process), so nice 10 stays.
- **One big text, two threads.** With 2+ threads, a big text is encoded as two halves at
  once when another thread is free (``split_encode``): the sizing thread's own CPU per
  30k-token prompt 5.3 -> 4.4 ms, at the price of a second encode competing with the loop.

Everything here runs at most ``threads`` encodes at once; more big requests queue for a
thread (each still counted exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from proxy.core.tokenizer import own_encodings, own_split, safe_cut

T = TypeVar("T")
Ids = npt.NDArray[np.uint32]

#: Linux nice of the sizing threads, above the event loop's 0.
WORKER_NICE = 10
#: Threads that size big requests (at most this many encodes at once): ``sizing.threads``.
THREADS = 1
#: Use SCHED_IDLE instead of a nice value (Linux; measured, see docs/benchmarks.md).
SCHED_IDLE = False
#: Encode a big text in two halves at once when another sizing thread is free.
SPLIT = True

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def lower_this_thread() -> None:
    """Lower the calling thread below the event loop's (Linux: a thread id names one thread)."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        if SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        else:
            nice = max(WORKER_NICE, os.getpriority(os.PRIO_PROCESS, tid))
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def _start_thread() -> None:
    lower_this_thread()
    own_encodings()
    # With one thread there is no other to hand a half to.
    own_split(split_encode if SPLIT and THREADS > 1 else None)


def split_encode(encode: Callable[[str], Ids], text: str) -> Ids:
    """``encode(text)`` as two halves at once: the second in another sizing thread if one is free.

    The half handed over is taken back when no thread has started it by the time this
    thread has encoded its own half (``Future.cancel``): never a wait on a busy pool, so
    no deadlock with every thread splitting at once, and under load it costs one queue
    round trip. The halves are cut where encoding them apart is exact (``safe_cut``).
    """
    cut = safe_cut(text, len(text) // 2)
    if cut is None:
        return encode(text)
    second = text[cut:]
    handed = executor().submit(encode, second)
    first = encode(text[:cut])
    rest = encode(second) if handed.cancel() else handed.result()
    return np.concatenate((first, rest))


def executor() -> ThreadPoolExecutor:
    """The process's sizing threads (started on first use; ``warm`` starts them all)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(1, THREADS),
                thread_name_prefix="kvroute-sizing",
                initializer=_start_thread,
            )
        return _pool


def configure(threads: int) -> None:
    """Use ``threads`` sizing threads from now on (a new pool when the number changes)."""
    global THREADS
    if threads != THREADS:
        THREADS = threads
        reset()


def reset() -> None:
    """Drop the pool (its threads end once idle); the next use starts a new one (tests, benches)."""
    global _pool
    with _lock:
        old, _pool = _pool, None
    if old is not None:
        old.shutdown(wait=False)


def _forget_in_child() -> None:
    # A forked child has none of the parent's threads: its first use starts its own pool.
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


async def run(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a sizing thread."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor(), functools.partial(fn, *args))


async def warm(prepare: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Start every sizing thread now and run ``prepare`` in each (builds its encodings).

    ``ThreadPoolExecutor`` starts a thread on a submit that finds none idle, and its
    ``Thread.start()`` waits, on the event loop, for the thread to run; building an
    encoding copy takes ~0.14 s. Both belong at startup, not in the first big requests.
    """
    n = max(1, THREADS)
    # Each call waits for all the others, so n distinct threads must be running at once.
    barrier = threading.Barrier(n)

    def meet() -> None:
        prepare()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout_s)

    await asyncio.gather(*(run(meet) for _ in range(n)))
