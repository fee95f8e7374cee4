"""When is a report stale? Judged against the collector's own progress, not only the wall clock.

A report is stamped when its scrape started (``MemoryReport.reported_at``). Under CPU load
the gateway's own event loop runs late: scrape rounds start late and their answers are
read late, so every report ages together, through no fault of the backends. Judged against
the wall clock, a loop that fell ``stale_after_s`` behind made every healthy node stale at
once, and requests that any of them could serve failed as "unavailable".

So staleness is judged at the time of the newest report in the fleet (what the collector
has most recently managed to take), not at ``now``: a node is stale when it has fallen
``stale_after_s`` behind the others, which is the backend's doing (a push that stopped, a
scrape that keeps failing). Only when even the newest report is older than
``COLLECTOR_STOPPED_FACTOR`` x ``stale_after_s`` (the collector itself stopped, or the
store lost every report) does the wall clock judge again, so nothing is routed on figures
that old. A fleet of one node is judged by that bound alone.
"""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot

# Beyond this many stale_after_s without any new report, the collector itself has stopped.
COLLECTOR_STOPPED_FACTOR = 3.0


def judged_at(snapshot: FleetSnapshot, now: float, stale_after_s: float) -> float:
    """The time reports are judged at: the newest report's, unless that too is far too old."""
    newest = max(
        (n.report.reported_at for n in snapshot.nodes if n.report is not None), default=now
    )
    if now - newest > COLLECTOR_STOPPED_FACTOR * stale_after_s:
        return now
    # A pushed report stamped ahead of this clock (skew) never moves judgement into the future.
    return min(now, newest)
