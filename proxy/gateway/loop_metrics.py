"""Metric children the request path updates without a lock.

prometheus_client guards every value with a lock, checks each increment, and a histogram's
``observe`` walks its bounds one by one. A tiny request made six locked increments and two
such walks: taking the request path's metrics out altogether saved ~4-5% of the gateway's
CPU per tiny request (docs/benchmarks.md, section 9). Those counters and histograms are
updated only on the event loop's thread (one loop per worker process, and no
multiprocess mode), so the lock guards nothing there.

``unlocked`` gives one child (a label set) of a prometheus_client ``Counter`` or
``Histogram`` plain values and a direct ``inc``/``observe``. Everything else stays
prometheus_client's: the registry, names, labels, ``labels()`` (which returns this same
child) and the exposition, which reads the values through the same ``get``.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)


class LoopValue:
    """prometheus_client's value interface (``inc``, ``set``, ``get``, exemplars), unlocked."""

    __slots__ = ("exemplar", "value")

    def __init__(self, value: float = 0.0) -> None:
        self.value = value
        self.exemplar: Any = None

    def inc(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self.exemplar = exemplar

    def get(self) -> float:
        return self.value

    def get_exemplar(self) -> Any:
        return self.exemplar


def unlocked(child: M) -> M:
    """``child`` (one label set, or an unlabelled metric) with plain values and a direct
    ``inc``/``observe``; any other metric is returned as it is."""
    if isinstance(child, Counter):
        _unlock_counter(child)
    elif isinstance(child, Histogram):
        _unlock_histogram(child)
    return child


def _unlock_counter(child: Counter) -> None:
    value = LoopValue(child._value.get())
    child._value = value
    plain_inc = Counter.inc

    def inc(amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if amount < 0 or exemplar:
            # The library's checks and messages (a negative amount, an exemplar to validate).
            plain_inc(child, amount, exemplar)
            return
        value.value += amount

    child.inc = inc  # type: ignore[method-assign]


def _unlock_histogram(child: Histogram) -> None:
    bounds = list(child._upper_bounds)
    total = LoopValue(child._sum.get())
    buckets = [LoopValue(b.get()) for b in child._buckets]
    child._sum = total
    child._buckets = buckets
    plain_observe = Histogram.observe
    last = len(bounds) - 1

    def observe(amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar:
            plain_observe(child, amount, exemplar)
            return
        total.value += amount
        # The first bound at or above the amount (the last is +Inf); NaN fits none.
        i = bisect_left(bounds, amount)
        if i <= last and amount <= bounds[i]:
            buckets[i].value += 1

    child.observe = observe  # type: ignore[method-assign]
