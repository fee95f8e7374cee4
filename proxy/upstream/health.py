"""Upstream health, per gateway replica: active probes and passive outlier ejection.

Two signals, as Envoy combines them:

* active: every ``interval_s`` each backend's health path is probed; ``fall`` failures in a
  row mark it unhealthy, ``rise`` successes in a row healthy again;
* passive (outlier ejection): ``consecutive_failures`` connect failures, timeouts or 5xx
  that are not allocation failures in a row eject a backend for ``base_ejection_s`` x the
  number of its ejections (capped at ``max_ejection_s``), never more than
  ``max_ejection_percent`` of the fleet at once. A ``Retry-After`` from a backend cools it
  down locally too (the shared cooldown goes to the store; this one works without it).

``avoid()`` is what routing uses: the backends to route around now, or none at all when
fewer than ``panic_threshold_percent`` of the fleet would be left (panic mode: routing to
every backend beats routing to none). State is per replica and never shared: each gateway
judges the backends by what it sees itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from proxy.config import HealthConfig
from proxy.tasks import PeriodicTask

log = logging.getLogger("kvroute.health")

Probe = Callable[[str], Awaitable[bool]]


@dataclass(slots=True)
class _State:
    healthy: bool = True  # the active checks' verdict
    probe_ok_run: int = 0
    probe_fail_run: int = 0
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    cooldown_until: float = 0.0
    ejections_total: int = 0

    def unavailable(self, now: float) -> bool:
        return not self.healthy or now < self.ejected_until or now < self.cooldown_until


# What ``avoid`` answers while every backend is well (no set built per request).
_NONE: frozenset[str] = frozenset()


class BackendHealth:
    """Health and ejection state of every backend, as this replica sees it."""

    def __init__(
        self, names: list[str], cfg: HealthConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self._s: dict[str, _State] = {n: _State() for n in names}
        self.panics_total = 0
        self._panicking = False

    def retain(self, names: list[str]) -> None:
        """Forget backends no longer in the fleet (they must not count in the panic share)."""
        keep = set(names)
        for gone in set(self._s) - keep:
            del self._s[gone]
        for name in names:
            self._st(name)

    def _st(self, name: str) -> _State:
        st = self._s.get(name)
        if st is None:
            st = self._s[name] = _State()
        return st

    # ------------------------------------------------------------- passive signals
    def success(self, name: str) -> None:
        self._st(name).consecutive_failures = 0

    def failure(self, name: str) -> bool:
        """One connect failure / timeout / non-allocation 5xx / garbage answer. True if it ejected now."""
        oc = self.cfg.outlier
        st = self._st(name)
        now = self.clock()
        if now < st.ejected_until:
            return False
        st.consecutive_failures += 1
        if st.consecutive_failures < oc.consecutive_failures:
            return False
        ejected = sum(1 for s in self._s.values() if now < s.ejected_until)
        limit = math.floor(len(self._s) * oc.max_ejection_percent / 100.0)
        if oc.max_ejection_percent > 0:
            limit = max(1, limit)
        if ejected + 1 > limit:
            return False  # over the cap: keep routing to it, the retries still go elsewhere
        if st.ejected_until and now - st.ejected_until > oc.max_ejection_s:
            st.ejections = 0  # well again for a long while: the multiplier starts over
        st.ejections += 1
        st.ejections_total += 1
        st.ejected_until = now + min(oc.base_ejection_s * st.ejections, oc.max_ejection_s)
        st.consecutive_failures = 0
        log.warning(
            "backend %s ejected for %.1fs (%d failures in a row)",
            name,
            st.ejected_until - now,
            oc.consecutive_failures,
        )
        return True

    def cooldown(self, name: str, seconds: float) -> None:
        st = self._st(name)
        st.cooldown_until = max(st.cooldown_until, self.clock() + seconds)

    # ------------------------------------------------------------- active signal
    def probe_result(self, name: str, ok: bool) -> None:
        ac = self.cfg.active
        st = self._st(name)
        if ok:
            st.probe_fail_run = 0
            st.probe_ok_run += 1
            if not st.healthy and st.probe_ok_run >= ac.rise:
                st.healthy = True
                log.info("backend %s healthy again (%d probes passed)", name, st.probe_ok_run)
        else:
            st.probe_ok_run = 0
            st.probe_fail_run += 1
            if st.healthy and st.probe_fail_run >= ac.fall:
                st.healthy = False
                log.warning("backend %s unhealthy (%d probes failed)", name, st.probe_fail_run)

    # ------------------------------------------------------------- routing view
    def unavailable(self, name: str, now: float) -> bool:
        return self._st(name).unavailable(now)

    def avoid(self) -> frozenset[str]:
        """Backends to route around now; empty in panic (too few would be left)."""
        now = self.clock()
        # No set built while every backend is well (every placement asks).
        bad = [n for n, st in self._s.items() if st.unavailable(now)]
        if not bad:
            self._panicking = False
            return _NONE
        bad_set = frozenset(bad)
        left = 100.0 * (len(self._s) - len(bad_set)) / len(self._s)
        panic = left < self.cfg.outlier.panic_threshold_percent
        if panic and not self._panicking:
            self.panics_total += 1
            log.warning("panic: only %.0f%% of backends healthy; routing to all", left)
        self._panicking = panic
        return _NONE if panic else bad_set

    def snapshot(self) -> dict[str, dict[str, object]]:
        now = self.clock()
        return {
            n: {
                "healthy": st.healthy,
                "ejected": now < st.ejected_until,
                "ejected_for_s": round(max(0.0, st.ejected_until - now), 3),
                "cooldown_for_s": round(max(0.0, st.cooldown_until - now), 3),
                "consecutive_failures": st.consecutive_failures,
                "ejections_total": st.ejections_total,
            }
            for n, st in self._s.items()
        }

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_HealthCollector(self))


class _HealthCollector(Collector):
    def __init__(self, health: BackendHealth) -> None:
        self._h = health

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "kvroute_backend_healthy", "1 while the active health checks pass", labels=["backend"]
        )
        ejected = GaugeMetricFamily(
            "kvroute_backend_ejected",
            "1 while passive outlier detection ejects the backend",
            labels=["backend"],
        )
        ejections = CounterMetricFamily(
            "kvroute_outlier_ejections", "Outlier ejections by backend", labels=["backend"]
        )
        for name, s in self._h.snapshot().items():
            healthy.add_metric([name], 1.0 if s["healthy"] else 0.0)
            ejected.add_metric([name], 1.0 if s["ejected"] else 0.0)
            ejections.add_metric([name], float(s["ejections_total"]))  # type: ignore[arg-type]
        panics = CounterMetricFamily(
            "kvroute_health_panics", "Times routing fell back to every backend (panic threshold)"
        )
        panics.add_metric([], float(self._h.panics_total))
        yield from (healthy, ejected, ejections, panics)


class ActiveChecker:
    """The probe loop: one task per gateway, all backends probed concurrently each round."""

    def __init__(
        self, health: BackendHealth, urls: dict[str, str], probe: Probe, interval_s: float
    ) -> None:
        self.health = health
        self.urls = urls
        self.probe = probe
        self.interval_s = interval_s
        self._rounds = PeriodicTask("kvroute-health", self.check_once, interval_s)

    async def _one(self, name: str, url: str) -> None:
        try:
            ok = await self.probe(url)
        except Exception:
            ok = False
        self.health.probe_result(name, ok)

    async def check_once(self) -> None:
        await asyncio.gather(*(self._one(n, u) for n, u in self.urls.items()))

    def start(self) -> None:
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
