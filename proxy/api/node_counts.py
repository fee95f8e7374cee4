"""Per backend: requests answered, requests that ended in an error, and failovers, for ``/fleet``.

Read from the gateway's own Prometheus counters when ``/fleet`` is rendered, so the request
path counts nothing twice. "Failovers" are attempts on a backend that failed (allocation,
overload, a broken or garbage answer, a timeout) after which the gateway moved on: to
another backend, or to an error answer when none was left.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter


def node_counts(requests: Counter, attempts: Counter) -> dict[str, dict[str, int]]:
    """{backend: {"requests", "errors", "failovers"}} from this replica's counters."""
    out: dict[str, dict[str, int]] = {}

    def slot(backend: str) -> dict[str, int]:
        return out.setdefault(backend, {"requests": 0, "errors": 0, "failovers": 0})

    for family in requests.collect():
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("backend"):
                counts = slot(s.labels["backend"])
                counts["requests"] += int(s.value)
                if s.labels.get("outcome") != "success":
                    counts["errors"] += int(s.value)
    for family in attempts.collect():
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("result") != "ok":
                slot(s.labels["backend"])["failovers"] += int(s.value)
    return out


def with_counts(
    items: list[dict[str, Any]], counts: dict[str, dict[str, int]]
) -> list[dict[str, Any]]:
    """Add each backend's counts (zeros for one that has seen nothing yet)."""
    for item in items:
        item["counts"] = counts.get(item["name"], {"requests": 0, "errors": 0, "failovers": 0})
    return items
