"""The collector: scrapes every backend's ``/metrics`` into the state store.

One asyncio task per gateway. Each round it scrapes all backends concurrently with one
shared ``httpx.AsyncClient`` on a thread and event loop of its own, so a gateway busy with
requests does not time its backends out (``proxy.backends.scrape_thread``), turns each
body into a ``MemoryReport``
(``proxy.backends.parse``) and writes it with ``put_report``; a backend that cannot be
scraped (connect error, timeout, non-200, unreadable metrics) is ``mark_down``-ed with the
reason. Fresh reports are also handed to the ``on_report`` hooks so in-process consumers
(admission queue, fragmentation trend) react without re-reading the store.

Several gateway replicas may share one Redis store: only the holder of the ``collector``
lock scrapes in a round, the others skip it and read what the holder wrote. If the lock
holder dies, its lock expires (about three intervals) and another replica takes over.
During a store outage every replica scrapes for itself (no lock is needed: with degraded
mode, proxy.state.degraded, the writes land in the replica's local store and it routes on
them; the shared writes fail and are counted), and local hooks keep getting fresh reports.

A report is stamped with when its figures were taken, at the latest: when its scrape was
handed to the scrape thread, on the store's clock (``StateStore.now``), not when the body
arrived. A reservation made during a slow
scrape then counts as not yet visible in it, and a report that started before a learned
ceiling cannot lift it. A backend is marked down after ``collector.fall`` failed scrapes in
a row and up again after ``collector.rise`` good ones, as the active health checks do (the
per-backend fetch, parse and fall/rise count are ``proxy.backends.scrape``). One
backend's unreadable metrics are that backend's scrape error only; nothing here ever
crashes the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from proxy.backends.base import ModelsInfo
from proxy.backends.parse import ScrapeError, parse_report
from proxy.backends.scrape import BackendStatus, ScrapeOutcome, scrape_client
from proxy.backends.scrape_thread import ScrapeThread
from proxy.backends.served_models import ModelsDirectory
from proxy.config import BackendConfig, Config
from proxy.core.fleet import MemoryReport
from proxy.state.base import StateStore, StoreUnavailable
from proxy.tasks import PeriodicTask
from proxy.upstream.tls import verifying_context

__all__ = ["LOCK_NAME", "Collector", "ReportHook", "ScrapeError", "ScrapeOutcome", "parse_report"]

log = logging.getLogger("kvroute.collector")

LOCK_NAME = "collector"


class ReportHook(Protocol):
    """Called as ``hook(name, report)`` after each successful scrape; may return an awaitable."""

    def __call__(self, name: str, report: MemoryReport) -> object: ...


@dataclass(slots=True)
class _Counters:
    rounds_total: int = 0  # rounds this replica scraped
    rounds_skipped_total: int = 0  # rounds skipped because another replica holds the lock
    round_errors_total: int = 0  # unexpected exceptions caught by the loop
    store_errors_total: int = 0  # StoreUnavailable on lock/put/mark_down
    hook_errors_total: int = 0
    last_round_at: float = 0.0
    leader: bool = False
    store_ok: bool = True
    backends: dict[str, BackendStatus] = field(default_factory=dict)


class Collector:
    """Scrape all configured backends every ``collector.scrape_interval_s`` into ``store``.

    ``owner_id`` identifies this gateway replica for the shared lock; ``clock`` gives the
    unix time stamped on reports (injectable for tests). Use ``start()``/``stop()`` for the
    background task, or ``scrape_once()`` to run one round now.
    """

    def __init__(
        self,
        config: Config,
        store: StateStore,
        owner_id: str,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._config = config
        self._store = store
        self._owner = owner_id
        self._clock = clock if clock is not None else store.now
        self._client: httpx.AsyncClient | None = None
        self._client_slots = 0
        self._background: set[asyncio.Task[None]] = set()  # old clients being closed
        self._thread = ScrapeThread(f"kvroute-scrapes-{owner_id}")
        self._loop = PeriodicTask(
            f"kvroute-collector-{owner_id}",
            lambda: self.scrape_once(),
            lambda: self.interval_s,
            on_error=self._round_failed,
        )
        self._counters = _Counters()
        self.on_report: list[ReportHook] = []
        self._models = ModelsDirectory()

    # --- configuration -----------------------------------------------------------------

    @property
    def interval_s(self) -> float:
        return self._config.collector.scrape_interval_s

    @property
    def lock_ttl_s(self) -> float:
        """About three intervals, and longer than a round with a timed-out scrape in it."""
        cc = self._config.collector
        return max(3.0 * cc.scrape_interval_s, cc.timeout_s + 2.0 * cc.scrape_interval_s)

    def reconfigure(self, config: Config) -> None:
        """Take a reloaded config; the next round scrapes the new backend list."""
        self._config = config
        names = {b.name for b in config.backends}
        for gone in set(self._counters.backends) - names:
            del self._counters.backends[gone]
        # URLs or kinds may have changed: ask every backend for its models again.
        self._models = ModelsDirectory()

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        """Stop the loop, hand the lock back (so another replica takes over at once), close the client."""
        await self._loop.stop(max(5.0, 3.0 * self._config.collector.timeout_s))
        if self._counters.leader:
            self._counters.leader = False
            try:
                await self._store.unlock(LOCK_NAME, self._owner)
            except StoreUnavailable:
                self._counters.store_errors_total += 1
                log.warning(
                    "collector: store unavailable while releasing the lock (it will expire)"
                )
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
        await self._thread.close()

    @property
    def running(self) -> bool:
        return self._loop.running

    def _round_failed(self, exc: Exception) -> None:
        self._counters.round_errors_total += 1
        log.error("collector: round failed", exc_info=exc)

    # --- one round -----------------------------------------------------------------------

    async def scrape_once(self) -> dict[str, ScrapeOutcome] | None:
        """Run one round; ``None`` when another replica holds the lock and this one skipped."""
        leader = await self._take_lock()
        backends = list(self._config.backends)
        # Every replica keeps its own model list (it is not in the store): refresh it
        # alongside the scrapes, or alone when another replica holds the lock.
        models = self._refresh_models(backends)
        if leader is False:
            await models
            self._counters.rounds_skipped_total += 1
            return None
        outcomes, _ = await asyncio.gather(
            asyncio.gather(*(self._scrape(b) for b in backends)), models
        )
        await asyncio.gather(*(self._publish(o) for o in outcomes))
        self._counters.rounds_total += 1
        self._counters.last_round_at = self._clock()
        return {o.name: o for o in outcomes}

    async def _take_lock(self) -> bool | None:
        """True: ours; False: another replica's; None: store unreachable (scrape locally anyway)."""
        try:
            got = await self._store.try_lock(LOCK_NAME, self._owner, self.lock_ttl_s)
        except StoreUnavailable as exc:
            self._store_failed("try_lock", exc)
            self._counters.leader = False
            return None
        self._store_recovered()
        if got != self._counters.leader:
            log.info("collector: %s %s the scrape lock", self._owner, "took" if got else "lost")
        self._counters.leader = got
        return got

    async def _http(self) -> httpx.AsyncClient:
        """The client of the model lists (``/v1/models``), sized to the fleet."""
        slots = self._slots()
        if self._client is not None and slots <= self._client_slots:
            return self._client
        cc = self._config.collector
        tls = await verifying_context()
        if self._client is not None and slots <= self._client_slots:
            # Another scrape built it while this one waited for the context.
            return self._client
        old = self._client
        self._client = scrape_client(slots, cc, tls)
        self._client_slots = slots
        if old is not None:
            closing = asyncio.get_running_loop().create_task(old.aclose())
            self._background.add(closing)
            closing.add_done_callback(self._background.discard)
        return self._client

    async def _scrape(self, backend: BackendConfig) -> ScrapeOutcome:
        # On its own thread and loop (proxy.backends.scrape_thread): a scrape timed on this
        # loop, when it is busy, times out through no fault of the backend.
        taken_at = self._clock()  # the figures are no older than this
        return await self._thread.scrape(backend, self._config.collector, self._slots(), taken_at)

    def _slots(self) -> int:
        """Connections per client: one per backend, so no request waits for one, and spare."""
        return len(self._config.backends) + 4

    async def _publish(self, o: ScrapeOutcome) -> None:
        """Count the outcome (fall/rise) and write what it asks for; hooks get fresh reports."""
        st = self._counters.backends.setdefault(o.name, BackendStatus())
        cc = self._config.collector
        write = st.record(o, self._clock(), cc.fall, cc.rise)
        if write == "report" and o.report is not None:
            backend = next((b for b in self._config.backends if b.name == o.name), None)
            report = st.with_slots(o.report, backend.max_num_seqs if backend else None)
            put = self._store.put_report(o.name, report, cc.report_ttl_s)
            await self._store_call("put_report", put)
            await self._run_hooks(o.name, report)
        elif write == "down":
            down = self._store.mark_down(o.name, st.reason, cc.report_ttl_s)
            await self._store_call("mark_down", down)

    async def _store_call(self, what: str, call: Awaitable[None]) -> None:
        try:
            await call
        except StoreUnavailable as exc:
            self._store_failed(what, exc)
        except Exception:  # a store bug: logged loudly, but the other backends still publish
            self._counters.round_errors_total += 1
            log.exception("collector: store %s failed unexpectedly", what)
        else:
            self._store_recovered()

    def _store_failed(self, what: str, exc: Exception) -> None:
        self._counters.store_errors_total += 1
        if self._counters.store_ok:
            log.warning("collector: state store unavailable (%s): %s", what, exc)
        self._counters.store_ok = False

    def _store_recovered(self) -> None:
        if not self._counters.store_ok:
            log.info("collector: state store reachable again")
        self._counters.store_ok = True

    async def _run_hooks(self, name: str, report: MemoryReport) -> None:
        for hook in list(self.on_report):
            try:
                result = hook(name, report)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a consumer's bug must not stop collection
                self._counters.hook_errors_total += 1
                log.exception("collector: on_report hook %r failed for %s", hook, name)

    # --- served models (GET /v1/models, cached) ------------------------------------------------

    def models(self, name: str) -> ModelsInfo | None:
        """What backend ``name``'s ``/v1/models`` last said (ids, max_model_len), or None."""
        return self._models.info.get(name)

    def served_models(self, backend: BackendConfig) -> tuple[str, ...]:
        """The model ids a backend serves: its configured ``models``, else what it lists."""
        return self._models.served(backend)

    async def _refresh_models(self, backends: list[BackendConfig]) -> None:
        every = self._config.collector.models_refresh_s
        await self._models.refresh(await self._http(), backends, self._clock(), every)

    # --- read-only view for metrics --------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A snapshot (a fresh dict) of counters and per-backend last outcomes, for /metrics.

        Per backend: ``outcome`` (ok|down|never), ``reason``, ``latency_s`` of the last
        scrape, ``last_scrape_at``/``last_success_at`` (unix), ``stale`` (no success within
        ``stale_after_s``), ``consecutive_failures``, ``scrapes_total``, ``failures_total``.
        Only the replica holding the lock scrapes, so the others show no per-backend data.
        """
        now = self._clock()
        stale_after = self._config.collector.stale_after_s
        backends: dict[str, dict[str, Any]] = {}
        for name, st in self._counters.backends.items():
            d = asdict(st)
            d["stale"] = st.last_success_at <= 0 or now - st.last_success_at > stale_after
            backends[name] = d
        return {
            "owner_id": self._owner,
            "running": self.running,
            "leader": self._counters.leader,
            "store_ok": self._counters.store_ok,
            "rounds_total": self._counters.rounds_total,
            "rounds_skipped_total": self._counters.rounds_skipped_total,
            "round_errors_total": self._counters.round_errors_total,
            "store_errors_total": self._counters.store_errors_total,
            "hook_errors_total": self._counters.hook_errors_total,
            "last_round_at": self._counters.last_round_at,
            "backends": backends,
        }
