"""The kvroute allocator gauges (``proxy.core.backend_contract``): kinds ``contiguous``, ``paged``.

Exported by custom servers and the simulated engine. They carry the largest contiguous free
block, the number fragmentation-aware routing is about, so they are exact: no derivation.
A ``paged`` backend without them may be a stock vLLM server and is read by vLLM's names.
"""

from __future__ import annotations

from typing import get_args

from proxy.backends import samples as sm
from proxy.backends.base import ErrorClass, ModelsInfo, generic_class, parse_openai_models
from proxy.core import backend_contract as bc
from proxy.core.fleet import AllocatorKind, MemoryReport

_ALLOCATORS: frozenset[str] = frozenset(get_args(AllocatorKind))
REQUIRED = (bc.CAPACITY, bc.FREE, bc.LARGEST_FREE_BLOCK)
WANTED: frozenset[str] = frozenset(
    {*REQUIRED, bc.ALLOCATOR_INFO, bc.START_TIME, bc.RUNNING, bc.WAITING}
)


def has_gauges(samples: sm.Samples) -> bool:
    return any(n in samples for n in REQUIRED)


def memory_report(
    samples: sm.Samples, kind: str, now: float, capacity_override: int | None
) -> MemoryReport:
    """The report from the kvroute gauges; ``kind`` gives the allocator when no info label does."""
    capacity = sm.count(bc.CAPACITY, sm.required_sum(samples, bc.CAPACITY))
    free = sm.count(bc.FREE, sm.required_sum(samples, bc.FREE))
    largest = sm.count(bc.LARGEST_FREE_BLOCK, sm.required_sum(samples, bc.LARGEST_FREE_BLOCK))
    if capacity <= 0 and capacity_override is None:
        raise sm.ScrapeError(f"{bc.CAPACITY} is {capacity}; a backend needs a positive capacity")
    allocator: AllocatorKind = "contiguous" if kind == "contiguous" else "paged"
    block_size = 1
    info = samples.get(bc.ALLOCATOR_INFO)
    if info:
        labels = info[0].labels
        label_alloc = labels.get("allocator", "")
        if label_alloc in _ALLOCATORS:
            # Checked against the Literal's values just above.
            allocator = label_alloc  # type: ignore[assignment]
        block_size = sm.int_label(labels, "block_size") or 1
    capacity, free, largest = sm.clamped(capacity, free, largest, capacity_override)
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator=allocator,
        block_size=block_size,
        running=sm.count(bc.RUNNING, sm.optional_sum(samples, bc.RUNNING)),
        waiting=sm.count(bc.WAITING, sm.optional_sum(samples, bc.WAITING)),
        started_at=sm.optional_max(samples, bc.START_TIME),
        reported_at=now,
    )


def missing() -> sm.ScrapeError:
    return sm.ScrapeError(f"required kvroute allocator gauges are missing ({', '.join(REQUIRED)})")


class KvrouteAdapter:
    """``contiguous`` and ``paged`` backends speaking the documented contract."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def parse_metrics(
        self, text: str, now: float, capacity_override: int | None = None
    ) -> MemoryReport:
        samples = sm.parse_selected(text, WANTED)
        if not has_gauges(samples):
            raise missing()
        return memory_report(samples, self.kind, now, capacity_override)

    def parse_models(self, body: bytes) -> ModelsInfo:
        return parse_openai_models(body)

    def classify_error(self, status: int, body: bytes) -> ErrorClass:
        if status == bc.ALLOCATION_ERROR_STATUS and (
            bc.ALLOCATION_ERROR_TYPE.encode() in body or bc.ALLOCATION_ERROR_CODE.encode() in body
        ):
            return "allocation"
        return generic_class(status)
