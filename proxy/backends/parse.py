"""Backend ``/metrics`` text -> ``MemoryReport``: the entry the collector calls.

Each server kind has its own adapter module (``kvroute``, ``vllm``, ``sglang``, ``tgi``);
this picks it by the backend's configured kind. No I/O and no clock: the scrape time comes
in as ``now``.
"""

from __future__ import annotations

from proxy.backends.registry import adapter_for
from proxy.backends.samples import Sample, Samples, ScrapeError
from proxy.core.fleet import MemoryReport

__all__ = ["Sample", "Samples", "ScrapeError", "parse_report"]


def parse_report(
    kind: str, text: str, now: float, capacity_override: int | None = None
) -> MemoryReport:
    """Turn one backend's ``/metrics`` text into a memory report taken at ``now``.

    ``kind`` is the backend's configured kind (see ``proxy.backends.registry``).
    ``capacity_override`` replaces the reported capacity and clamps free and largest-block
    figures to it. Raises ``ScrapeError``.
    """
    return adapter_for(kind).parse_metrics(text, now, capacity_override)
