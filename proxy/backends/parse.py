"""Backend ``/metrics`` text -> ``MemoryReport``: the pure half of the collector.

No I/O and no clock: the scrape time comes in as ``now``. The Prometheus text is parsed by
``prometheus_client``'s own parser (never by hand), then reduced to the few gauges kvroute
needs. Two dialects are understood:

* the documented kvroute allocator gauges (``proxy.core.backend_contract``), exported by custom
  servers and the simulated engine; they carry the largest contiguous free block, which is
  the number fragmentation-aware routing is about;
* vLLM's own names, for stock vLLM servers: free tokens are derived from the KV usage
  fraction and the cache geometry in ``vllm:cache_config_info``. vLLM's cache is paged, so
  any free block can hold any part of a sequence: the largest usable "block" is all of it.

A vLLM-kind backend that also exports the kvroute gauges (a patched server) is read by the
kvroute gauges, which are exact.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import get_args

from prometheus_client.parser import text_string_to_metric_families

from proxy.config import BackendKind
from proxy.core import backend_contract as bc
from proxy.core.fleet import AllocatorKind, MemoryReport

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ScrapeError as ScrapeError

_ALLOCATORS: frozenset[str] = frozenset(get_args(AllocatorKind))


@dataclass(frozen=True, slots=True)
class Sample:
    labels: dict[str, str]
    value: float


class Samples:
    """Parsed exposition indexed by *sample* name (``foo_total``, ``bar_info``, ``vllm:x``).

    Indexing by sample rather than family name keeps lookups independent of how the
    exporter declared the type (an ``_info`` gauge, a counter's ``_total`` suffix).
    """

    def __init__(self, by_name: dict[str, list[Sample]]) -> None:
        self._by_name = by_name

    @classmethod
    def parse(cls, text: str, keep: frozenset[str] | None = None) -> Samples:
        """Parse exposition text; with ``keep``, only the lines of those metric names."""
        by_name: dict[str, list[Sample]] = {}
        try:
            for family in text_string_to_metric_families(_only(text, keep) if keep else text):
                for s in family.samples:
                    by_name.setdefault(s.name, []).append(Sample(dict(s.labels), float(s.value)))
        except (
            Exception
        ) as exc:  # the parser raises ValueError, but also IndexError/TypeError on junk
            first = text.strip().splitlines()[0][:80] if text.strip() else ""
            raise ScrapeError(
                f"not valid Prometheus text exposition ({type(exc).__name__}: {exc}); starts with {first!r}"
            ) from None
        return cls(by_name)

    def __contains__(self, name: str) -> bool:
        return bool(self._by_name.get(name))

    def get(self, name: str) -> list[Sample]:
        return self._by_name.get(name, [])

    def names(self) -> set[str]:
        return set(self._by_name)


def _only(text: str, keep: frozenset[str]) -> str:
    """The lines of ``text`` that belong to metrics named in ``keep`` (samples and their comments).

    Why: a vLLM server exports dozens of histograms (tens of kB); running the full parser
    over them costs tens of milliseconds of event-loop time per scrape, while the few
    gauges kvroute reads parse in microseconds. This only selects lines by metric name;
    names, labels and values are still parsed by prometheus_client.
    """
    lines = _line_selector(keep).findall(text)
    lines.append("")
    return "\n".join(lines)


@functools.cache
def _line_selector(keep: frozenset[str]) -> re.Pattern[str]:
    names = "|".join(re.escape(n) for n in sorted(keep, key=len, reverse=True))
    return re.compile(
        rf"^[ \t]*((?:#[ \t]+(?:HELP|TYPE)[ \t]+)?(?:{names})(?=[ \t{{\r]|$).*?)\r?$", re.MULTILINE
    )


# --- small helpers ----------------------------------------------------------------------


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ScrapeError(f"{name} is {value}, not a finite number")
    return value


def _one(samples: Samples, name: str) -> float:
    """A gauge that must be present; several label sets are summed (e.g. one per model)."""
    found = samples.get(name)
    if not found:
        raise ScrapeError(f"required metric {name} is missing")
    return _finite(name, math.fsum(s.value for s in found))


def _optional_sum(samples: Samples, name: str, default: float = 0.0) -> float:
    found = samples.get(name)
    if not found:
        return default
    return _finite(name, math.fsum(s.value for s in found))


def _optional_max(samples: Samples, name: str) -> float:
    """For start times: with several label sets, the most recent (re)start is the one that counts."""
    found = [s.value for s in samples.get(name) if math.isfinite(s.value)]
    return max(found) if found else 0.0


def _count(name: str, value: float) -> int:
    if value < 0:
        raise ScrapeError(f"{name} is negative ({value})")
    return int(value)


def _int_label(labels: dict[str, str], key: str) -> int | None:
    """An integer label value; vLLM writes "None" for values it does not know yet."""
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        v = int(float(raw))
    except ValueError:
        return None
    return v if v > 0 else None


def _clamped(
    capacity: int,
    free: int,
    largest: int,
    capacity_override: int | None,
) -> tuple[int, int, int]:
    if capacity_override is not None:
        capacity = capacity_override
    free = max(0, min(free, capacity))
    largest = max(0, min(largest, free))
    return capacity, free, largest


# --- the kvroute allocator gauges ---------------------------------------------------------

_KVROUTE_REQUIRED = (bc.CAPACITY, bc.FREE, bc.LARGEST_FREE_BLOCK)


def has_kvroute_gauges(samples: Samples) -> bool:
    return any(n in samples for n in _KVROUTE_REQUIRED)


def _kvroute_report(
    samples: Samples, kind: BackendKind, now: float, capacity_override: int | None
) -> MemoryReport:
    capacity = _count(bc.CAPACITY, _one(samples, bc.CAPACITY))
    free = _count(bc.FREE, _one(samples, bc.FREE))
    largest = _count(bc.LARGEST_FREE_BLOCK, _one(samples, bc.LARGEST_FREE_BLOCK))
    if capacity <= 0 and capacity_override is None:
        raise ScrapeError(f"{bc.CAPACITY} is {capacity}; a backend needs a positive capacity")

    allocator: AllocatorKind = "contiguous" if kind == "contiguous" else "paged"
    block_size = 1
    info = samples.get(bc.ALLOCATOR_INFO)
    if info:
        labels = info[0].labels
        label_alloc = labels.get("allocator", "")
        if label_alloc in _ALLOCATORS:
            allocator = label_alloc  # type: ignore[assignment]  # checked against the Literal's values
        block_size = _int_label(labels, "block_size") or 1

    capacity, free, largest = _clamped(capacity, free, largest, capacity_override)
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator=allocator,
        block_size=block_size,
        running=_count(bc.RUNNING, _optional_sum(samples, bc.RUNNING)),
        waiting=_count(bc.WAITING, _optional_sum(samples, bc.WAITING)),
        started_at=_optional_max(samples, bc.START_TIME),
        reported_at=now,
    )


# --- vLLM's own names ---------------------------------------------------------------------


def has_vllm_gauges(samples: Samples) -> bool:
    return bc.VLLM_KV_USAGE in samples or bc.VLLM_KV_USAGE_DEPRECATED in samples


def _engine_key(labels: dict[str, str]) -> str:
    """vLLM V1 labels per-engine series with ``engine`` (data parallel); older ones have none."""
    return labels.get("engine", "")


def _vllm_geometry(samples: Samples) -> dict[str, tuple[int | None, int | None]]:
    """engine -> (block_size, num_gpu_blocks) from ``vllm:cache_config_info`` labels."""
    out: dict[str, tuple[int | None, int | None]] = {}
    for s in samples.get(bc.VLLM_CACHE_CONFIG):
        out[_engine_key(s.labels)] = (
            _int_label(s.labels, "block_size"),
            _int_label(s.labels, "num_gpu_blocks"),
        )
    return out


def _vllm_report(samples: Samples, now: float, capacity_override: int | None) -> MemoryReport:
    usage_name = bc.VLLM_KV_USAGE if bc.VLLM_KV_USAGE in samples else bc.VLLM_KV_USAGE_DEPRECATED
    usage_samples = samples.get(usage_name)
    if not usage_samples:
        raise ScrapeError(
            f"required metric {bc.VLLM_KV_USAGE} (or the older {bc.VLLM_KV_USAGE_DEPRECATED}) is missing"
        )
    # One usage fraction per engine; the same engine under several model names is one cache.
    usage: dict[str, float] = {}
    for s in usage_samples:
        u = _finite(usage_name, s.value)
        if not 0.0 <= u <= 1.0 + 1e-9:
            raise ScrapeError(f"{usage_name} is {u}, expected a fraction between 0 and 1")
        key = _engine_key(s.labels)
        usage[key] = max(usage.get(key, 0.0), min(u, 1.0))

    geometry = _vllm_geometry(samples)
    shared = next(iter(geometry.values())) if len(geometry) == 1 else None
    capacity = 0
    free = 0
    largest = 0
    block_sizes: set[int] = set()
    for engine, u in sorted(usage.items()):
        block_size, num_blocks = geometry.get(engine, shared or (None, None))
        if block_size:
            block_sizes.add(block_size)
        if block_size and num_blocks:
            engine_capacity = block_size * num_blocks
            engine_free = round((1.0 - u) * num_blocks) * block_size
        elif capacity_override is not None:
            # No geometry (not exported yet, or "None"): the operator's capacity stands in.
            engine_capacity = capacity_override // len(usage)
            engine_free = int((1.0 - u) * engine_capacity)
        else:
            where = f" for engine {engine!r}" if engine else ""
            raise ScrapeError(
                f"{bc.VLLM_CACHE_CONFIG}{where} lacks usable block_size/num_gpu_blocks labels "
                "(set capacity_tokens on the backend to scrape it anyway)"
            )
        capacity += engine_capacity
        free += engine_free
        # Paged: every free block is usable by one request, but a request lives on one engine.
        largest = max(largest, engine_free)
    if capacity <= 0 and capacity_override is None:
        raise ScrapeError("vLLM reports a KV cache of zero tokens")

    capacity, free, largest = _clamped(capacity, free, largest, capacity_override)
    return MemoryReport(
        capacity_tokens=capacity,
        free_tokens=free,
        largest_free_block_tokens=largest,
        allocator="paged",
        block_size=min(block_sizes) if block_sizes else 1,
        running=_count(bc.VLLM_RUNNING, _optional_sum(samples, bc.VLLM_RUNNING)),
        waiting=_count(bc.VLLM_WAITING, _optional_sum(samples, bc.VLLM_WAITING)),
        started_at=_optional_max(samples, bc.VLLM_START_TIME),
        reported_at=now,
    )


# --- entry point ----------------------------------------------------------------------------


def report_from_samples(
    kind: BackendKind, samples: Samples, now: float, capacity_override: int | None = None
) -> MemoryReport:
    if has_kvroute_gauges(samples):
        return _kvroute_report(samples, kind, now, capacity_override)
    if kind != "contiguous" and has_vllm_gauges(samples):
        return _vllm_report(samples, now, capacity_override)
    if kind == "vllm":
        raise ScrapeError(
            f"required metric {bc.VLLM_KV_USAGE} (or {bc.VLLM_KV_USAGE_DEPRECATED}, "
            f"or the kvroute gauges {', '.join(_KVROUTE_REQUIRED)}) is missing"
        )
    raise ScrapeError(
        f"required kvroute allocator gauges are missing ({', '.join(_KVROUTE_REQUIRED)})"
    )


def parse_report(
    kind: BackendKind, text: str, now: float, capacity_override: int | None = None
) -> MemoryReport:
    """Turn one backend's ``/metrics`` text into a memory report taken at ``now``.

    ``kind`` is the backend's configured kind: ``contiguous``/``paged`` read the kvroute
    allocator gauges (a paged backend may fall back to vLLM's names); ``vllm`` reads vLLM's
    names unless the kvroute gauges are present. ``capacity_override`` replaces the reported
    capacity and clamps free and largest-block figures to it. Raises ``ScrapeError``.
    """
    try:
        return report_from_samples(kind, Samples.parse(text, _WANTED), now, capacity_override)
    except ScrapeError:
        # Say "not metrics at all" rather than "metric X missing" when the text is junk
        # (an HTML error page served with 200, a truncated body): the full parse tells.
        Samples.parse(text)
        raise


_WANTED: frozenset[str] = frozenset(
    {
        bc.CAPACITY,
        bc.FREE,
        bc.LARGEST_FREE_BLOCK,
        bc.ALLOCATOR_INFO,
        bc.START_TIME,
        bc.RUNNING,
        bc.WAITING,
        bc.VLLM_KV_USAGE,
        bc.VLLM_KV_USAGE_DEPRECATED,
        bc.VLLM_RUNNING,
        bc.VLLM_WAITING,
        bc.VLLM_CACHE_CONFIG,
        bc.VLLM_START_TIME,
    }
)
