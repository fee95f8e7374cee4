"""Backend ``/metrics`` text -> ``MemoryReport``: the entry the collector calls.

Each server kind has its own adapter module (``kvroute``, ``vllm``, ``sglang``, ``tgi``,
``llamacpp``); this picks it by the backend's configured kind. A kind whose state takes more
than ``/metrics`` (llama.cpp's ``/props`` and ``/slots``) names those pages (``pages_for``)
and gets their bodies too. No I/O and no clock: the scrape time comes in as ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.backends.base import PagesAdapter
from proxy.backends.registry import adapter_for
from proxy.backends.samples import Sample, Samples, ScrapeError
from proxy.config.base import KvLayout
from proxy.core.fleet import MemoryReport

__all__ = ["Sample", "Samples", "ScrapeError", "pages_for", "parse_report"]


def pages_for(kind: str) -> tuple[str, ...]:
    """The paths a scrape of ``kind`` reads besides its metrics path (most kinds: none)."""
    adapter = adapter_for(kind)
    return adapter.pages if isinstance(adapter, PagesAdapter) else ()


def parse_report(
    kind: str,
    text: str,
    now: float,
    capacity_override: int | None = None,
    pages: Mapping[str, bytes] | None = None,
    kv_layout: KvLayout = "unified",
) -> MemoryReport:
    """Turn one backend's ``/metrics`` text (and ``pages``) into a memory report taken at ``now``.

    ``kind`` is the backend's configured kind (see ``proxy.backends.registry``).
    ``capacity_override`` replaces the reported capacity and clamps free and largest-block
    figures to it. ``pages``: the bodies of ``pages_for(kind)`` by path; ``kv_layout``: how
    a llama.cpp server's slots share its cache. Raises ``ScrapeError``.
    """
    adapter = adapter_for(kind)
    if isinstance(adapter, PagesAdapter):
        return adapter.parse_pages(text, pages or {}, kv_layout, now, capacity_override)
    return adapter.parse_metrics(text, now, capacity_override)
