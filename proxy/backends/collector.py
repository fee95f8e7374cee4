"""The collector: scrapes every backend's ``/metrics`` into the state store.

One asyncio task per gateway. Each round it scrapes all backends concurrently with one
shared ``httpx.AsyncClient``, turns each body into a ``MemoryReport``
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

A report is stamped with when its figures were taken: the scrape's start, on the store's
clock (``StateStore.now``), not when the body arrived. A reservation made during a slow
scrape then counts as not yet visible in it, and a report that started before a learned
ceiling cannot lift it. A backend is marked down after ``collector.fall`` failed scrapes in
a row and up again after ``collector.rise`` good ones, as the active health checks do. One
backend's unreadable metrics are that backend's scrape error only; nothing here ever
crashes the loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import httpx

from proxy.backends.base import ModelsInfo
from proxy.backends.models import ModelsDirectory
from proxy.backends.parse import ScrapeError, parse_report
from proxy.config import BackendConfig, Config
from proxy.core.fleet import MemoryReport
from proxy.state.base import StateStore, StoreUnavailable
from proxy.tasks import PeriodicTask

__all__ = ["LOCK_NAME", "Collector", "ReportHook", "ScrapeError", "ScrapeOutcome", "parse_report"]

log = logging.getLogger("kvroute.collector")

LOCK_NAME = "collector"
MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any real /metrics page; stops a runaway body
ACCEPT = (
    "text/plain;version=0.0.4;q=1.0, */*;q=0.1"  # the classic text format that the parser reads
)


class ReportHook(Protocol):
    """Called as ``hook(name, report)`` after each successful scrape; may return an awaitable."""

    def __call__(self, name: str, report: MemoryReport) -> object: ...


@dataclass(frozen=True, slots=True)
class ScrapeOutcome:
    """One backend's result in one round: a report, or the reason it was marked down."""

    name: str
    report: MemoryReport | None
    reason: str = ""
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.report is not None


@dataclass(slots=True)
class _BackendStatus:
    outcome: Literal["ok", "down", "never"] = "never"
    reason: str = ""
    latency_s: float | None = None
    last_scrape_at: float = 0.0
    last_success_at: float = 0.0
    consecutive_failures: int = 0
    consecutive_ok: int = 0
    scrapes_total: int = 0
    failures_total: int = 0


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
    backends: dict[str, _BackendStatus] = field(default_factory=dict)


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

    def _http(self) -> httpx.AsyncClient:
        """One client for all scrapes, sized to the fleet so no scrape waits for a connection."""
        slots = len(self._config.backends) + 4
        if self._client is not None and slots <= self._client_slots:
            return self._client
        old = self._client
        cc = self._config.collector
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(cc.timeout_s),
            limits=httpx.Limits(
                max_connections=slots,
                max_keepalive_connections=slots,
                keepalive_expiry=2.0 * cc.scrape_interval_s
                + 5.0,  # reuse connections across rounds
            ),
            headers={"Accept": ACCEPT, "User-Agent": "kvroute-collector"},
            follow_redirects=False,
            trust_env=False,  # backends are scraped directly, never through an environment proxy
        )
        self._client_slots = slots
        if old is not None:
            closing = asyncio.get_running_loop().create_task(old.aclose())
            self._background.add(closing)
            closing.add_done_callback(self._background.discard)
        return self._client

    async def _scrape(self, backend: BackendConfig) -> ScrapeOutcome:
        path = (
            backend.metrics_path
            if backend.metrics_path.startswith("/")
            else "/" + backend.metrics_path
        )
        url = backend.plain_url + path
        cred = backend.credential()
        timeout_s = self._config.collector.timeout_s
        client = self._http()
        taken_at = self._clock()  # the figures are no older than this
        started = time.perf_counter()
        deadline = started + timeout_s
        try:
            # Bounded by httpx's own per-phase timeouts (connect, send, each read) plus the
            # deadline checked per chunk, which stops a server that drips its body. Not by
            # asyncio.timeout: a native cancellation racing httpx's timeouts can be lost.
            async with client.stream(
                "GET", url, headers={"authorization": cred} if cred is not None else None
            ) as resp:
                if resp.status_code != 200:
                    raise ScrapeError(f"HTTP {resp.status_code} from {path}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise ScrapeError(f"metrics body larger than {MAX_BODY_BYTES} bytes")
                    if time.perf_counter() > deadline:
                        raise ScrapeError(f"timeout after {timeout_s:g}s (body still arriving)")
            text = body.decode("utf-8", errors="replace")  # the text format is UTF-8 by definition
            report = parse_report(backend.kind, text, taken_at, backend.capacity_tokens)
        except ScrapeError as exc:
            return self._failed(backend, exc.reason, started)
        except httpx.TimeoutException:
            return self._failed(backend, f"timeout after {timeout_s:g}s", started)
        except httpx.ConnectError as exc:
            return self._failed(backend, f"connect error: {exc or type(exc).__name__}", started)
        except httpx.HTTPError as exc:
            return self._failed(backend, f"{type(exc).__name__}: {exc}", started)
        except Exception as exc:
            # An odd value the parser did not foresee (block_size="inf": OverflowError) is this
            # backend's problem only: the round goes on and publishes every other backend.
            log.debug("collector: %s: unreadable metrics", backend.name, exc_info=True)
            return self._failed(
                backend, f"unreadable metrics: {type(exc).__name__}: {exc}", started
            )
        return ScrapeOutcome(backend.name, report, "", time.perf_counter() - started)

    def _failed(self, backend: BackendConfig, reason: str, started: float) -> ScrapeOutcome:
        return ScrapeOutcome(backend.name, None, reason, time.perf_counter() - started)

    async def _publish(self, o: ScrapeOutcome) -> None:
        st = self._counters.backends.setdefault(o.name, _BackendStatus())
        now = self._clock()
        st.scrapes_total += 1
        st.last_scrape_at = now
        st.latency_s = o.latency_s
        if o.report is not None:
            st.last_success_at = now
            st.consecutive_failures = 0
            st.consecutive_ok += 1
            await self._publish_ok(o.name, o.report, st)
        else:
            st.consecutive_failures += 1
            st.consecutive_ok = 0
            st.failures_total += 1
            await self._publish_failed(o.name, o.reason, st)

    async def _publish_ok(self, name: str, report: MemoryReport, st: _BackendStatus) -> None:
        """A good scrape; a backend marked down needs ``rise`` of them in a row to be up again."""
        ttl = self._config.collector.report_ttl_s
        rise = self._config.collector.rise
        if st.outcome == "down" and st.consecutive_ok < rise:
            why = f"recovering: {st.consecutive_ok} of {rise} good scrapes"
            st.reason = why
            await self._store_call("mark_down", self._store.mark_down(name, why, ttl))
            return
        if st.outcome == "down":
            log.info("collector: backend %s is reachable again", name)
        st.outcome, st.reason = "ok", ""
        await self._store_call("put_report", self._store.put_report(name, report, ttl))
        await self._run_hooks(name, report)

    async def _publish_failed(self, name: str, reason: str, st: _BackendStatus) -> None:
        """A failed scrape; ``fall`` in a row mark the backend down (one slow scrape does not)."""
        fall = self._config.collector.fall
        if st.outcome != "down" and st.outcome != "never" and st.consecutive_failures < fall:
            # Still up on its last report, which ages; the reason is kept for /metrics.
            st.reason = f"{reason} ({st.consecutive_failures} of {fall} failed scrapes)"
            return
        if st.outcome != "down":
            log.warning("collector: backend %s marked down: %s", name, reason)
        st.outcome, st.reason = "down", reason
        ttl = self._config.collector.report_ttl_s
        await self._store_call("mark_down", self._store.mark_down(name, reason, ttl))

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
        await self._models.refresh(self._http(), backends, self._clock(), every)

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
