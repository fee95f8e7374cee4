"""Prometheus text -> samples by name, plus the small number checks every adapter shares.

The text is parsed by ``prometheus_client``'s own parser (never by hand). Adapters then read
the few series they need by *sample* name, so a lookup does not depend on how the exporter
declared the type (an ``_info`` gauge, a counter's ``_total`` suffix).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The error tree lives in proxy.errors; re-exported where adapters have always found it.
from proxy.errors import ScrapeError as ScrapeError


@dataclass(frozen=True, slots=True)
class Sample:
    labels: dict[str, str]
    value: float


class Samples:
    """Parsed exposition indexed by sample name (``foo_total``, ``bar_info``, ``vllm:x``)."""

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
        # The parser raises ValueError, but also IndexError/TypeError on junk.
        except Exception as exc:
            first = text.strip().splitlines()[0][:80] if text.strip() else ""
            raise ScrapeError(
                f"not valid Prometheus text exposition ({type(exc).__name__}: {exc}); "
                f"starts with {first!r}"
            ) from None
        return cls(by_name)

    def __contains__(self, name: str) -> bool:
        return bool(self._by_name.get(name))

    def get(self, name: str) -> list[Sample]:
        return self._by_name.get(name, [])

    def names(self) -> set[str]:
        return set(self._by_name)


def _only(text: str, keep: frozenset[str]) -> str:
    """The lines of ``text`` that belong to metrics named in ``keep`` (samples and comments).

    Why: a vLLM server exports dozens of histograms (tens of kB); running the full parser
    over them costs tens of milliseconds of event-loop time per scrape, while the few gauges
    kvroute reads parse in microseconds. Names, labels and values are still parsed by
    prometheus_client; this only selects lines by metric name.
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


def parse_selected(text: str, wanted: frozenset[str]) -> Samples:
    """Parse only ``wanted``; junk text still fails as "not valid exposition", not "missing X"."""
    samples = Samples.parse(text, wanted)
    if not any(n in samples for n in wanted):
        # Say "not metrics at all" rather than "metric X missing" when the text is junk
        # (an HTML error page served with 200, a truncated body): the full parse tells.
        Samples.parse(text)
    return samples


# --- number checks -------------------------------------------------------------------------


def finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ScrapeError(f"{name} is {value}, not a finite number")
    return value


def required_sum(samples: Samples, name: str) -> float:
    """A gauge that must be present; several label sets are summed (e.g. one per model)."""
    found = samples.get(name)
    if not found:
        raise ScrapeError(f"required metric {name} is missing")
    return finite(name, math.fsum(s.value for s in found))


def optional_sum(samples: Samples, name: str, default: float = 0.0) -> float:
    found = samples.get(name)
    if not found:
        return default
    return finite(name, math.fsum(s.value for s in found))


def optional_max(samples: Samples, name: str) -> float:
    """For start times: with several label sets, the most recent (re)start is the one that counts."""
    found = [s.value for s in samples.get(name) if math.isfinite(s.value)]
    return max(found) if found else 0.0


def count(name: str, value: float) -> int:
    if value < 0:
        raise ScrapeError(f"{name} is negative ({value})")
    return int(value)


def int_label(labels: dict[str, str], key: str) -> int | None:
    """A positive integer label value; vLLM writes "None" for values it does not know yet."""
    raw = labels.get(key)
    if raw is None:
        return None
    try:
        v = int(float(raw))
    except ValueError:
        return None
    return v if v > 0 else None


def fraction(name: str, value: float) -> float:
    """A 0..1 usage figure; a percentage (0..100) is a different metric and is refused."""
    u = finite(name, value)
    if not 0.0 <= u <= 1.0 + 1e-9:
        raise ScrapeError(f"{name} is {u}, expected a fraction between 0 and 1")
    return min(u, 1.0)


def by_label(samples: Iterable[Sample], key: str) -> dict[str, list[Sample]]:
    """Group samples by one label's value ("" where the label is absent)."""
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.labels.get(key, ""), []).append(s)
    return out


def clamped(
    capacity: int, free: int, largest: int, capacity_override: int | None
) -> tuple[int, int, int]:
    """Apply the operator's capacity override and keep largest <= free <= capacity."""
    if capacity_override is not None:
        capacity = capacity_override
    free = max(0, min(free, capacity))
    largest = max(0, min(largest, free))
    return capacity, free, largest
