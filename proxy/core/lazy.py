"""Fit accounting for servers that allocate KV as they go (vLLM, SGLang, TGI).

A lazily allocating server's usage covers only tokens already in its cache: a request that
is still prefilling or decoding will grow up to prompt + max_tokens, and that growth looks
free in the report. Subtracting only the reservations made after the report (the contiguous
rule) therefore over-admits, and the server then queues or preempts: the client sees it as
latency, not as an error. So for these servers:

    committed = max(reported used, full demand of everything the gateway has in flight there)

Assumptions (the model): the gateway is the server's only client, so each in-flight
request's allocation so far is part of ``used`` and never exceeds its full demand; ``max``
then counts every in-flight request at its full demand without counting its allocated part
twice, while usage the gateway does not know about (requests finished since the report,
other clients) still counts through ``used``. Prefix-cached blocks that are free count as
free, as the servers report them.

Data parallel: the server picks the engine (by queue length), and the gateway cannot know
how its in-flight requests are split. Headroom is the smallest over engines of
``engine capacity - max(engine used, all in-flight demand)``: safe whatever the split, and
conservative (it assumes the whole in-flight demand could sit on the engine that gets the
next request).

Contiguous servers that allocate everything at admission keep the exact rule: the largest
free block less the reservations newer than the report (``NodeView.usable_block``).
"""

from __future__ import annotations

from typing import Protocol


class MemoryReport(Protocol):
    """What these rules read of ``proxy.core.fleet.MemoryReport`` (fleet.py calls them: a
    protocol here keeps the two modules out of an import circle)."""

    @property
    def capacity_tokens(self) -> int: ...
    @property
    def free_tokens(self) -> int: ...
    @property
    def largest_free_block_tokens(self) -> int: ...
    @property
    def engine_free_tokens(self) -> tuple[int, ...]: ...
    @property
    def queueing(self) -> bool: ...


def allocates_lazily(report: MemoryReport) -> bool:
    """Servers that queue and grow their allocation (the adapters set ``queueing``)."""
    return report.queueing


def committed_tokens(used: int, inflight_demand: int) -> int:
    """Tokens spoken for on one cache: what it holds, or what in-flight work will hold."""
    return max(used, inflight_demand)


def lazy_headroom(report: MemoryReport, inflight_demand: int, engine: int | None = None) -> int:
    """The largest new request that surely fits, with every in-flight request at full demand.

    ``engine``: the data-parallel engine the gateway pins the request to
    (``X-data-parallel-rank``); only that engine's room counts, since the server's front end
    does not choose. None: the smallest over all engines (the front end may pick any).
    """
    frees = report.engine_free_tokens or (report.free_tokens,)
    per_engine_capacity = report.capacity_tokens // len(frees)
    if engine is not None and 0 <= engine < len(frees):
        free = frees[engine]
        room = per_engine_capacity - committed_tokens(per_engine_capacity - free, inflight_demand)
        return max(0, min(room, free))
    room = min(
        per_engine_capacity - committed_tokens(per_engine_capacity - free, inflight_demand)
        for free in frees
    )
    # A report's own "largest" (e.g. 0 for a sleeping engine) is never exceeded.
    return max(0, min(room, report.largest_free_block_tokens))


def projected_headroom(report: MemoryReport, committed: int, engine: int | None = None) -> int:
    """The largest new request that fits where the projected peak already counts the usage.

    ``committed``: what the node will hold at its projected peak with the new request, less
    the new request's own demand (``proxy.gateway.memory_pressure``), with the usage its
    flights do not explain (other clients, finished work not yet reported) added. Then the
    new request fits when its demand fits beside that, and nothing else is asked: a lazily
    allocating server takes the prompt now and grows it while others end. The rule of
    ``lazy_headroom`` also asked its whole demand of the KV free now (``max(used, ...)``),
    which the projection had already passed: measured on the disaggregation benchmark, a
    document held 5.5 s for room it was never going to need at once.

    A data-parallel server whose front end picks the engine keeps ``lazy_headroom``'s worst
    split (the gateway does not know which engine gets the request). A report with no free
    block at all (an engine asleep, or full) has no room.
    """
    if report.largest_free_block_tokens <= 0:
        return 0
    frees = report.engine_free_tokens or (report.free_tokens,)
    if len(frees) > 1 and (engine is None or not 0 <= engine < len(frees)):
        return lazy_headroom(report, committed)
    return max(0, report.capacity_tokens // len(frees) - committed)
