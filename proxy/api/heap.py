"""The heap a gateway holds once started, frozen out of the cyclic garbage collector's walks.

Why: serving tiny requests at concurrency 32, a full (generation 2) collection ran about
every 1.3 s and walked the ~110,000 objects held since startup (modules, config and
pydantic models, Prometheus metrics, routing tables), stopping the event loop 41-47 ms each
time; p99 latency was 35-37 ms against a p50 of 7 ms. Those objects live as long as the
process and are never garbage while it serves. After ``gc.freeze()`` the same collections
walk only what serving allocated since: none took over 3 ms, and p99 fell to 17-18 ms
(docs/benchmarks.md, Issue 12). Done once, at the end of startup, by ``kvroute serve``
(each worker of ``--workers N`` in its own process); a config reload's new objects are not
frozen, and stay collectable.

The young generation's threshold goes from CPython's 700 allocations to ``YOUNG_THRESHOLD``
at the same time. A request allocates a few hundred tracked objects, so at 700 a young
collection ran every request or two, and at 64 requests in flight it walked mostly the live
objects of the others (then promoted them, to be walked again in the next generation): 10x
fewer young collections made tiny requests ~6% cheaper in CPU (docs/benchmarks.md, section
9; 20,000 and 50,000 gained no more). Only cyclic garbage waits for a collection; everything
else is freed by its reference count as before, so at most that many more objects wait.
"""

from __future__ import annotations

import gc

#: Allocations between two collections of the youngest generation (CPython's default: 700).
YOUNG_THRESHOLD = 7_000


def freeze_startup_heap() -> int:
    """Collect what startup left as garbage, then freeze everything still alive (moved to
    the permanent generation, which collections skip), and collect the young generation
    less often. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()
