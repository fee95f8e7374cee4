"""Warn when a backend reports an allocator other than its configured ``kind``.

A config that says ``kind: contiguous`` for a paged server (or the reverse) makes the fit check
wrong in a way nothing else reveals: the gateway trusts the configured kind for parsing and
the report for fitting. The collector's reports carry the allocator the backend itself
exports, so the mismatch is checked there: logged once per backend and allocator, and shown
on ``/fleet`` as a warning next to the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.config import Config
from proxy.core.fleet import MemoryReport

log = logging.getLogger("kvroute.config")

# What each configured kind should report. vLLM's, SGLang's and TGI's caches are paged.
EXPECTED_ALLOCATOR = {
    "contiguous": "contiguous",
    "paged": "paged",
    "vllm": "paged",
    "sglang": "paged",
    "tgi": "paged",
}


def kind_mismatch(cfg: Config, name: str, allocator: str | None) -> str | None:
    """The warning for this backend, or None when the report agrees with the config."""
    try:
        kind = cfg.backend(name).kind
    except KeyError:
        return None
    expected = EXPECTED_ALLOCATOR.get(kind)
    if allocator is None or expected is None or allocator == expected:
        return None
    return (
        f"configured kind {kind!r} but the backend reports a {allocator} allocator: "
        f"set `kind` to match (fit checks assume {expected})"
    )


class KindCheck:
    """A collector ``on_report`` hook: log each mismatch once, not on every scrape."""

    def __init__(self, cfg: Callable[[], Config]) -> None:
        self._cfg = cfg
        self._warned: set[tuple[str, str]] = set()

    def on_report(self, name: str, report: MemoryReport) -> None:
        warning = kind_mismatch(self._cfg(), name, report.allocator)
        key = (name, report.allocator)
        if warning is not None and key not in self._warned:
            self._warned.add(key)
            log.warning("backend %s: %s", name, warning)
