"""The task that keeps this replica's lease (proxy.state.lease), and its metrics.

Renews every third of ``store.lease_ttl_s``: two renewals in a row may fail (a Redis
blip, a busy loop) before the lease lapses. Each round also removes the leases that lapsed
and sweeps their reservations (one replica finds each lapse), counted here. A lease of our
own that lapsed makes a new epoch: ``on_new_epoch`` marks the ledger unsure (its next
reserve re-asserts first) and ``reassert`` re-asserts at once what this replica still holds,
under the new id, so a replica that was only slow counts again without waiting for a request.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PrometheusCollector

from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.lease import Lease, LeaseRound
from proxy.tasks import PeriodicTask

log = logging.getLogger("kvroute.lease")


def replica_base_id() -> str:
    """This process's lease base: host, pid and a random suffix (a restarted pid differs)."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host[:40] or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


class LeaseKeeper:
    """Holds ``store``'s lease: registers it, renews it, counts what the rounds find."""

    def __init__(
        self,
        store: StateStore,
        ttl_s: float,
        on_new_epoch: Callable[[], None] = lambda: None,
        reassert: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self._reassert = reassert
        self.lease = Lease(replica_base_id(), ttl_s)
        store.hold_lease(self.lease)
        self.lease.on_new.append(lambda _id: on_new_epoch())
        self.lapsed = 0  # other replicas' leases (and our own old ones) this one swept
        self.dropped = 0  # their live reservations swept with them
        self.dropped_tokens = 0
        self.registrations = 0  # 1 at start, +1 each time our own lease had lapsed
        self.failures = 0
        self.live = 0
        self._task = PeriodicTask("kvroute-lease", self.renew, ttl_s / 3.0, on_error=self._failed)

    async def renew(self) -> LeaseRound:
        now = self.store.now()
        round_ = await self.store.renew_lease(now)
        self.registrations += int(round_.new)
        if round_.new and self.registrations > 1:
            log.warning("lease lapsed; registered anew as %s", round_.lease)
            if self._reassert is not None:
                await self._reassert()
        if round_.lapsed:
            self.lapsed += len(round_.lapsed)
            self.dropped += round_.dropped
            self.dropped_tokens += round_.dropped_tokens
            log.warning(
                "leases lapsed: %s; %d reservations (%d tokens) dropped with them",
                ", ".join(round_.lapsed),
                round_.dropped,
                round_.dropped_tokens,
            )
        self.live = len(await self.store.live_leases(now))
        return round_

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        if not isinstance(exc, StoreUnavailable):
            log.error("lease renewal failed", exc_info=exc)

    async def start(self) -> None:
        """Register now (quietly: a store down at start is degraded mode), then keep renewing."""
        try:
            await self.renew()
        except StoreUnavailable as exc:
            self._failed(exc)
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()


class LeaseMetrics(PrometheusCollector):
    """``kvroute_lease_*`` series of one ``LeaseKeeper`` (docs/observability.md)."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self._k = keeper

    def collect(self) -> Iterator[Metric]:
        k = self._k
        for name, text, value in (
            (
                "kvroute_leases_lapsed",
                "Replica leases found lapsed and swept by this replica",
                k.lapsed,
            ),
            (
                "kvroute_lease_reservations_dropped",
                "Live reservations swept with a lapsed replica lease",
                k.dropped,
            ),
            (
                "kvroute_lease_reserved_tokens_dropped",
                "Tokens of the reservations swept with a lapsed replica lease",
                k.dropped_tokens,
            ),
            (
                "kvroute_lease_registrations",
                "This replica's lease registrations: 1 at start, +1 each time it had lapsed",
                k.registrations,
            ),
            ("kvroute_lease_renew_failures", "Lease renewals that failed", k.failures),
        ):
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], float(value))
            yield counter
        live = GaugeMetricFamily(
            "kvroute_replicas_live", "Gateway replicas whose lease was live at the last renewal"
        )
        live.add_metric([], float(k.live))
        yield live
