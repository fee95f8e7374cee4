"""Diagnosis: is this fragmentation (restart the node) or capacity (add replicas)?

Pure: reports, snapshots and times go in, verdicts come out; no I/O, no clock. Three parts:

- ``classify_failure``/``failure_from_hook``: one allocation failure, with the fleet's free
  fraction at the time and whether restarting some node would have made it fit.
- ``FailureLog``: recent failures, for the advice and ``allocation_failure_rate_at_high_free_memory``.
- ``FragmentationTracker``: per backend, the fragmentation ratio against uptime since the last
  restart, its least-squares slope (per hour) and Pearson correlation over a window, and
  restarts seen as a jump back of the start time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from proxy.core.fleet import FailureCause, FleetSnapshot, MemoryReport
from proxy.core.fleet import classify_failure as classify_failure

# The gateway's label for an allocation failure (proxy.core.fleet, shared with the gateway).
Cause = FailureCause
Level = Literal["ok", "high", "severe", "full", "unknown"]

HIGH_FREE_FRACTION = 0.25  # the problem statement's line: failures above it are not exhaustion
HIGH_RATIO = 0.6  # largest_contiguous_free_block_ratio below this: schedule a restart
SEVERE_RATIO = 0.5  # below this: restart now
RATE_WINDOW_S = 60.0  # allocation_failure_rate_at_high_free_memory is per second over this window


def level(report: MemoryReport | None, min_free_fraction: float = 0.1) -> Level:
    """The alert levels of the problem statement, for one node's report.

    A node with (almost) nothing free is ``full``: however its few free tokens lie, that is a
    capacity matter that a restart does not fix.
    """
    if report is None:
        return "unknown"
    if report.free_fraction <= min_free_fraction:
        return "full"
    ratio = report.largest_block_ratio
    if ratio < SEVERE_RATIO:
        return "severe"
    if ratio < HIGH_RATIO:
        return "high"
    return "ok"


@dataclass(frozen=True, slots=True)
class Failure:
    """One allocation failure as the gateway saw it."""

    at: float
    backend: str  # "" when nothing fit at the gateway
    cause: Cause  # the gateway's label (also on kvroute_allocation_failures_total)
    demand: int
    fleet_free_fraction: float
    fixable_by_restart: bool  # some single node held enough free memory: defragmenting it would fit
    room_on: tuple[str, ...] = ()  # the nodes that had that much free memory in total

    @property
    def at_high_free(self) -> bool:
        return self.fleet_free_fraction > HIGH_FREE_FRACTION


def nodes_with_room(snapshot: FleetSnapshot | None, demand: int) -> tuple[str, ...]:
    """Nodes up and reporting whose total free memory (less pending reservations) holds ``demand``."""
    if snapshot is None:
        return ()
    return tuple(
        sorted(
            n.name
            for n in snapshot.nodes
            if n.up and n.report is not None and n.usable_free() >= demand
        )
    )


def failure_from_hook(
    snapshot: FleetSnapshot | None,
    backend: str,
    cause: str,
    demand: int,
    fleet_free_fraction: float,
    now: float,
    room_on: tuple[str, ...] | None = None,
) -> Failure:
    """Turn the gateway's ``on_allocation_failure`` call into a ``Failure``.

    The gateway judges each node once (``proxy.routing.nothing_fits``): fragmentation when a
    node that could have taken the request held enough free memory in total, and ``room_on``
    names those nodes; a restart of one of them fixes it. Without ``room_on`` (an older
    caller) the nodes with room are read from ``snapshot``.
    """
    c: Cause = "fragmentation" if cause == "fragmentation" else "capacity"
    room = nodes_with_room(snapshot, demand) if room_on is None else tuple(room_on)
    fixable = c == "fragmentation" if backend or room_on is not None else bool(room)
    if backend and fixable and backend not in room:
        room = (*room, backend)
    return Failure(now, backend, c, demand, fleet_free_fraction, fixable, room)


class FailureLog:
    """Recent allocation failures, oldest first, bounded in count and age."""

    def __init__(self, keep_s: float = 3600.0, max_items: int = 10_000) -> None:
        self.keep_s = keep_s
        self._items: deque[Failure] = deque(maxlen=max_items)

    def add(self, failure: Failure) -> None:
        self._items.append(failure)

    def prune(self, now: float) -> None:
        while self._items and self._items[0].at < now - self.keep_s:
            self._items.popleft()

    def recent(self, now: float, window_s: float) -> list[Failure]:
        return [f for f in self._items if now - window_s <= f.at <= now]

    def rate_at_high_free(self, now: float, window_s: float = RATE_WINDOW_S) -> float:
        """Failures per second over ``window_s`` that happened while the fleet was > 25% free."""
        return sum(1 for f in self.recent(now, window_s) if f.at_high_free) / window_s

    def __len__(self) -> int:
        return len(self._items)


# --------------------------------------------------------------------- trend over uptime


@dataclass(frozen=True, slots=True)
class TrendSettings:
    window_s: float = 6 * 3600.0  # uptime window the regression looks at
    sample_interval_s: float = 60.0  # keep at most one sample per this much uptime
    min_samples: int = 10
    slope_per_hour: float = 0.002  # rising: slope above this ...
    min_correlation: float = 0.7  # ... and correlation above this ...
    min_fragmentation: float = 0.3  # ... and the ratio itself above this
    max_samples: int = 4096


@dataclass(frozen=True, slots=True)
class Trend:
    """The fragmentation ratio of one node against its uptime since its last restart."""

    samples: int
    slope_per_hour: float  # least-squares slope of fragmentation per hour of uptime
    correlation: float  # Pearson r of fragmentation with uptime (0 when either is constant)
    fragmentation: float  # latest
    uptime_s: float  # latest
    rising: bool


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ys on xs and Pearson's r; (0, 0) when undefined."""
    n = len(xs)
    if n < 2 or n != len(ys):
        return 0.0, 0.0
    mx = math.fsum(xs) / n
    my = math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    if sxx <= 0.0:
        return 0.0, 0.0
    slope = sxy / sxx
    if syy <= 1e-18:
        return slope, 0.0
    r = sxy / math.sqrt(sxx * syy)
    return slope, max(-1.0, min(1.0, r))


@dataclass(slots=True)
class _Series:
    started_at: float
    last_reported_at: float = 0.0
    points: deque[tuple[float, float]] = field(default_factory=deque)  # (uptime_s, fragmentation)


@dataclass(frozen=True, slots=True)
class Restart:
    """A backend came back with a newer start time than before."""

    backend: str
    previous_started_at: float
    started_at: float


class FragmentationTracker:
    """Per backend: fragmentation against uptime since the last restart.

    Fed with every report the gateway sees (the same report twice counts once). A report with
    a later ``started_at`` than the series means the node restarted: the series starts over
    and ``observe`` returns a ``Restart``. Backends that report no start time are tracked
    against the time since the first report seen.
    """

    def __init__(self, settings: TrendSettings | None = None) -> None:
        self.settings = settings or TrendSettings()
        self._series: dict[str, _Series] = {}

    def observe(self, name: str, report: MemoryReport) -> Restart | None:
        s = self._series.get(name)
        restart: Restart | None = None
        started = (
            report.started_at
            if report.started_at > 0
            else (s.started_at if s else report.reported_at)
        )
        if s is not None and started > s.started_at + 1e-6:
            restart = Restart(name, s.started_at, started)
            s = None
        if s is None:
            s = _Series(started_at=started)
            self._series[name] = s
        if report.reported_at <= s.last_reported_at:
            return restart  # seen already (or older than what we have)
        s.last_reported_at = report.reported_at
        uptime = max(0.0, report.reported_at - s.started_at)
        frag = report.fragmentation
        st = self.settings
        if s.points and uptime - s.points[-1][0] < st.sample_interval_s:
            # Too close to the last sample: the latest value wins, the spacing stays.
            s.points[-1] = (s.points[-1][0], frag)
        else:
            s.points.append((uptime, frag))
        while s.points and s.points[0][0] < uptime - st.window_s:
            s.points.popleft()
        while len(s.points) > st.max_samples:
            s.points.popleft()
        return restart

    def forget(self, name: str) -> None:
        self._series.pop(name, None)

    def keep_only(self, names: Iterable[str]) -> None:
        keep = set(names)
        for gone in set(self._series) - keep:
            del self._series[gone]

    def names(self) -> list[str]:
        return sorted(self._series)

    def started_at(self, name: str) -> float | None:
        s = self._series.get(name)
        return s.started_at if s is not None else None

    def trend(self, name: str) -> Trend | None:
        """None until the window holds ``min_samples`` samples."""
        s = self._series.get(name)
        st = self.settings
        if s is None or len(s.points) < st.min_samples:
            return None
        xs = [p[0] / 3600.0 for p in s.points]
        ys = [p[1] for p in s.points]
        slope, r = fit(xs, ys)
        latest_uptime, latest = s.points[-1]
        rising = (
            slope > st.slope_per_hour and r > st.min_correlation and latest > st.min_fragmentation
        )
        return Trend(len(xs), slope, r, latest, latest_uptime, rising)

    def trends(self) -> dict[str, Trend]:
        out: dict[str, Trend] = {}
        for name in self._series:
            t = self.trend(name)
            if t is not None:
                out[name] = t
        return out
