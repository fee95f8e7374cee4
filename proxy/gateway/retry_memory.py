"""The client's retry-key list: nodes that could not allocate this request, and when.

A client that retries (same ``Idempotency-Key`` / ``X-Request-Id``, or the same body with
``retry.hash_body``) must not be sent back to a node that just failed to allocate it. Only
KV allocation failures go on the list: a 429, a 5xx or a timeout says nothing about this
request's size and belongs to health, cooldown and outlier ejection; on a small fleet
listing them made the client's retry find nothing and get a false "fragmentation" 503.

Each entry is stored as ``name@time`` (backend names cannot hold ``@``), so that the rule a
learned ceiling follows applies here too: a report taken after the failure that shows a
free block big enough for the request lifts the entry. A bare name (an older replica's
entry) stays until the key expires.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.core.fleet import FleetSnapshot


def entry(backend: str, failed_at: float) -> str:
    """The list entry for an allocation failure on ``backend`` at ``failed_at`` (the store's time)."""
    return f"{backend}@{failed_at:.3f}"


def parse(item: str) -> tuple[str, float | None]:
    """``(backend, failed_at)``; ``failed_at`` is None for a bare name."""
    name, sep, when = item.rpartition("@")
    if not sep:
        return item, None
    try:
        return name, float(when)
    except ValueError:
        return item, None


def still_excluded(items: Iterable[str], snap: FleetSnapshot, demand: int) -> set[str]:
    """The nodes the retry must still avoid: those no newer report has shown room on since."""
    nodes = snap.by_name()
    out: set[str] = set()
    for item in items:
        name, failed_at = parse(item)
        node = nodes.get(name)
        report = node.report if node is not None else None
        lifted = (
            failed_at is not None
            and report is not None
            and report.reported_at > failed_at
            and report.largest_free_block_tokens >= demand
        )
        if not lifted:
            out.add(name)
    return out
