"""One request through the gateway: the README's seven steps, one call each.

``Gateway.handle`` is the walk; each step lives in its own module of this package:
``intake`` (parse, size, classify), ``placement`` (rank, reserve, wait), ``attempt`` with
``answers`` and ``stream`` (forward and relay), ``divert`` (what a failed attempt leaves
behind). The per-request values travel in one ``RequestContext``; the ``Gateway`` holds only
what outlives a request (config, store, health, budget, ledger, background work).

Fault handling (docs/reliability.md): an attempt that fails before anything reached the
client (connect error, timeout, 5xx that is not an allocation failure, a garbage answer,
a body that broke off) is retried on another backend, within the retry budget; after the
first byte a failure ends the stream with a final SSE error event. Every failure feeds
passive outlier ejection (``proxy.upstream.health``); store calls go through a circuit breaker and
every reservation is released, or its release retried, whatever happens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from proxy.config import Config
from proxy.core.redact import safe_request_id
from proxy.core.sample_gate import SampleGate
from proxy.core.validation import Endpoint
from proxy.errors import ApiError
from proxy.gateway import continuation, disaggregated, intake, placement
from proxy.gateway.admission import Admission
from proxy.gateway.affinity import Affinity
from proxy.gateway.background import Background
from proxy.gateway.context import RequestContext
from proxy.gateway.continuation_metrics import ContinuationMetrics
from proxy.gateway.divert import AllocationFailureHook
from proxy.gateway.early_prefills import EarlyPrefillBook
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.live_streams import LiveStreams
from proxy.gateway.local_view import LocalReservations
from proxy.gateway.memory_pressure import MemoryPressure
from proxy.gateway.metrics import GatewayMetrics
from proxy.gateway.models import CatalogCache, KindErrors, ModelsLookup
from proxy.gateway.queueing import BackendQueues
from proxy.gateway.relay import OnceCallback, RelayResponse
from proxy.gateway.resilience_metrics import ResilienceCollector
from proxy.gateway.retry_budget import RetryBudget
from proxy.gateway.stream import Break, StreamRelay
from proxy.gateway.token_counts import TokenCounts
from proxy.gateway.ttft_check import TtftCheck
from proxy.routing.policy import Policy
from proxy.state.base import StateStore
from proxy.state.deadline import lag_tolerant_timeout
from proxy.state.fleet_cache import FleetCache
from proxy.upstream.client import Upstream, header
from proxy.upstream.health import ActiveChecker, BackendHealth

log = logging.getLogger("kvroute.gateway")

#: The HTTP client's own limit on a health probe, in ``health.active.timeout_s``: a backstop
#: behind the lag-tolerant one (``Gateway._probe``).
PROBE_BACKSTOP = 3.0


def _then(
    first: Callable[[], Awaitable[None]], then: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """``first``, then ``then`` whatever ``first`` raised."""

    async def both() -> None:
        try:
            await first()
        finally:
            await then()

    return both


class Gateway:
    """What outlives a request: config, store, fleet view, health, retry budget, ledger."""

    def __init__(
        self,
        cfg: Config,
        store: StateStore,
        fleet: FleetCache,
        policy: Policy,
        upstream: Upstream,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.fleet = fleet
        self.policy = policy
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        self.active = 0
        # Read at scrape time: no locked gauge update twice per request.
        metrics.active.set_function(lambda: self.active)
        self._reach_backends(cfg)
        self._keep_reservations(cfg, store, fleet, metrics)
        self._rank_and_hold(cfg, metrics)
        # The one helper for background work and guarded store calls (the steps' ``tasks``).
        self.tasks = Background(
            self.ledger,
            self.local,
            self.pressure,
            self.breaker,
            metrics.store_errors,
            self.admission,
        )
        self.health.register(metrics.registry)
        metrics.registry.register(ResilienceCollector(self.breaker, self.budget, self.ledger))

    def _reach_backends(self, cfg: Config) -> None:
        """Each backend's URL and credential, and what its answers and model lists say."""
        # Without user:pass@ (aiohttp refuses those next to an Authorization header): each
        # backend's credential goes as a header instead, in place of the client's.
        self.urls = {b.name: b.plain_url for b in cfg.backends}
        self.credentials = {b.name: b.credential() for b in cfg.backends}
        for b in cfg.backends:
            if b.api_key_env is not None and self.credentials[b.name] is None:
                log.warning("backend %s: environment variable %s is not set", b.name, b.api_key_env)
        self.health = BackendHealth([b.name for b in cfg.backends], cfg.health)
        self.checker: ActiveChecker | None = None
        self._probe_headers: dict[str, dict[str, str]] = {}
        # What each backend's /v1/models said (the collector's cache; the app wires it).
        self.models_info: ModelsLookup = lambda name: None
        self.catalogs = CatalogCache()
        # A backend kind's own reading of an error answer (its adapter's classify_error);
        # the app wires the adapters in. Unset, the generic verdict stands.
        self.kind_errors: KindErrors = lambda kind, status, body: None
        # Streams being relayed, ended by a shutdown whose drain time is over (proxy.api.drain).
        self.live_streams = LiveStreams()

    def _keep_reservations(
        self, cfg: Config, store: StateStore, fleet: FleetCache, metrics: GatewayMetrics
    ) -> None:
        """The store's breaker, the ledger of reservations, this replica's view of them."""
        self.breaker = fleet.breaker
        self.budget = RetryBudget(cfg.retry.budget_percent, cfg.retry.budget_min_concurrency)
        self.ledger = ReservationLedger(
            store,
            self.breaker,
            cfg.store.reservation_ttl_s,
            on_error=lambda op: metrics.store_errors.labels(op).inc(),
        )
        # A store outage (failover) may have lost reservations the store acknowledged.
        fleet.on_degraded_change.append(self._store_lost)
        # This replica's reservations in flight, laid over the cached snapshot when ranking
        # (and those it released, over a snapshot read before the release).
        self.local = LocalReservations(fleet.clock)
        self.on_allocation_failure: list[AllocationFailureHook] = []

    def _rank_and_hold(self, cfg: Config, metrics: GatewayMetrics) -> None:
        """What ranking and holding learn as requests pass: affinity, queues, KV pressure."""
        self.admission = Admission(cfg.queue.max_size)
        # Prefix-cache and session affinity of this replica (proxy.gateway.affinity).
        self.affinity = Affinity(cfg)
        self.queues = BackendQueues(cfg, metrics.registry)
        # Expected TTFT per node (routing.prefix.ttft_aware) at the learned prefill rates.
        self.affinity.rates = lambda snap: self.queues.current(snap).rates
        # Prefills run while their request waits for a decode server (bounded per server).
        self.early_prefills = EarlyPrefillBook(metrics.registry)
        # Projected KV peaks, learned output lengths, held-request fairness (paged engines).
        self.pressure = MemoryPressure(cfg, metrics.registry, self.clock)
        # The model checks itself: predicted against observed TTFT; blind ranking while it misses.
        self.ttft_check = TtftCheck(metrics.registry)
        # The servers' usage.prompt_tokens against the gateway's counts, per model.
        self.token_counts = TokenCounts(cfg, metrics.registry)
        # Both learn from JSON answers at a bounded rate (proxy.core.sample_gate).
        self.answer_samples = SampleGate()
        self.continuation_metrics = ContinuationMetrics(metrics.registry)

    # ---------------------------------------------------------------- the walk
    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        # 128 random bits as 32 hex digits, like uuid4().hex (measured 0.8 vs 4.2 us).
        reservation_id = os.urandom(16).hex()
        # ``header``: no KeyError raised and caught when the client sent none (profiled: 1.6%).
        request_id = safe_request_id(header(request.headers, "x-request-id")) or reservation_id
        # Read once: the whole walk uses the config it started with, whatever a reload does.
        cfg, policy = self.cfg, self.policy
        try:
            # 1. parse + validate the body
            parsed = await intake.read_and_parse(cfg, request, endpoint)
        except ApiError as err:
            self.metrics.rejected.labels(err.code or "invalid").inc()
            return err.response({"x-request-id": request_id})
        self.active += 1
        answer: Response | None = None
        try:
            # 2. count tokens -> KV demand, 3. classify short/long
            ctx = await intake.open_request(
                self, request, parsed, reservation_id, request_id, started, cfg, policy
            )
            answer = await self._route(ctx)
            return answer
        except ApiError as err:
            return err.response({"x-request-id": request_id})
        finally:
            if isinstance(answer, RelayResponse):
                # A stream is still being answered: it stays active until it ends.
                answer.on_close = OnceCallback(_then(answer.on_close, self._stream_ended))
            else:
                self._request_ended()

    def _request_ended(self) -> None:
        self.active -= 1

    async def _stream_ended(self) -> None:
        self._request_ended()

    async def _route(self, ctx: RequestContext) -> Response:
        disaggregated.begin(self, ctx)
        try:
            while True:
                # A two-step request that must wait for a decode server prefills meanwhile.
                early = await disaggregated.prefill_while_holding(self, ctx)
                if early is not None:
                    return early
                # 4. rank candidates, 5. reserve on the best that accepts (or wait, or give up)
                placed = await placement.place(self, ctx)
                if isinstance(placed, Response):
                    return disaggregated.finish(self, ctx, placed)
                # A two-step request: step 1 on a prefill server, for the decode placed here.
                ended = await disaggregated.prefill_if_wanted(self, ctx, placed)
                if ended is not None:
                    return ended
                # 6. forward + relay; 7. the reservation is released whatever the outcome
                answer = await disaggregated.forward(self, ctx, placed)
                if answer is not None:
                    return disaggregated.finish(self, ctx, answer)
                # diverted before the first byte: try the next candidate
                await placement.move_on(self, ctx, placed)
                disaggregated.after_divert(self, ctx, placed)
        finally:
            self.budget.release(ctx.retries)
            self.pressure.forget(ctx)
            disaggregated.end(self, ctx)

    def prefill_during_hold(self, ctx: RequestContext) -> Awaitable[Response | None]:
        """Step 1 of a held two-step request, now that a prefill server has its share free."""
        return disaggregated.prefill_while_holding(self, ctx, during_hold=True)

    def _store_lost(self, degraded: bool) -> None:
        """A store outage (a failover) may have lost reservations it acknowledged."""
        if degraded:
            self.ledger.mark_unsure()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the active health checks (needs the upstream session started)."""
        ac = self.cfg.health.active
        if ac.enabled and self.checker is None:
            path = ac.path if ac.path.startswith("/") else "/" + ac.path
            urls = {name: url + path for name, url in self.urls.items()}
            self._probe_headers = {urls[n]: self.auth_headers(n) for n in urls}
            self.checker = ActiveChecker(self.health, urls, self._probe, ac.interval_s)
            self.checker.start()

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed backend list (discovery). URLs of removed backends are kept, so a
        request already placed on one still reaches it; probes cover the current list only."""
        self.cfg = cfg
        self.token_counts.reconfigure(cfg)
        self.urls.update({b.name: b.plain_url for b in cfg.backends})
        self.credentials.update({b.name: b.credential() for b in cfg.backends})
        self.health.retain([b.name for b in cfg.backends])
        self.pressure.reconfigure(cfg)
        if self.checker is not None:
            path = cfg.health.active.path
            path = path if path.startswith("/") else "/" + path
            self.checker.urls = {b.name: b.plain_url + path for b in cfg.backends}
            self._probe_headers = {
                b.plain_url + path: self.auth_headers(b.name) for b in cfg.backends
            }

    async def _probe(self, url: str) -> bool:
        """One active health check. Its time limit forgives this loop's own lateness, as a
        store call's does (``proxy.state.deadline``): a probe needs several turns of the
        loop, and on a busy gateway plain ``asyncio.timeout`` fires before the read of an
        answer already waiting in the socket (tests/gateway/test_health_probe.py); ``fall``
        of those in a row would mark a healthy backend unhealthy. The client's own limit is
        only a backstop."""
        headers = self._probe_headers.get(url)
        timeout_s = self.cfg.health.active.timeout_s
        async with lag_tolerant_timeout(timeout_s):
            status, _ = await self.upstream.get(url, PROBE_BACKSTOP * timeout_s, headers)
        return 200 <= status < 300

    def auth_headers(self, backend: str) -> dict[str, str]:
        """Headers of the gateway's own calls to ``backend`` (probes, model lists): its credential."""
        cred = self.credentials.get(backend)
        return {"authorization": cred} if cred is not None else {}

    async def close(self) -> None:
        """Shutdown: stop probing, let background work finish, release every reservation still held."""
        if self.checker is not None:
            await self.checker.stop()
            self.checker = None
        await self.tasks.drain()
        await self.ledger.close()

    # ---------------------------------------------------------------- ports of the steps
    def carry_on(self, relay: StreamRelay, broken: Break) -> AsyncIterator[bytes]:
        """The relay's port to the continuation (``proxy.gateway.stream.StreamPorts``)."""
        return continuation.carry_on(self, relay, broken)
