"""One request through the gateway: size, classify, rank, reserve, forward, divert, release.

This module orchestrates; the decisions live in pure modules (``tokens``, ``policy``,
``upstream_errors``) and the I/O in ``forward`` and the state store.

Fault handling (docs/reliability.md): an attempt that fails before anything reached the
client (connect error, timeout, 5xx that is not an allocation failure, a garbage answer,
a body that broke off) is retried on another backend, within the retry budget; after the
first byte a failure ends the stream with a final SSE error event. Every failure feeds
passive outlier ejection (``proxy.upstream.health``); store calls go through a circuit breaker and
every reservation is released, or its release retried, whatever happens.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot
from proxy.core.tokens import count_prompt_async
from proxy.core.validation import Endpoint, ParsedRequest, parse_request
from proxy.errors import ApiError, sse_error_event
from proxy.gateway.admission import Admission
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.metrics import GatewayMetrics
from proxy.gateway.relay import OnceCallback, RelayResponse
from proxy.gateway.resilience_metrics import ResilienceCollector
from proxy.gateway.retry_budget import RetryBudget
from proxy.routing.policy import Policy, RequestClass, RouteRequest, classify, nothing_fits_reason
from proxy.state.base import StateStore, StoreUnavailable
from proxy.state.fleet_cache import FleetCache
from proxy.upstream.classify import (
    UpstreamVerdict,
    classify_response,
    is_json_object,
    looks_like_sse,
)
from proxy.upstream.client import (
    BodyTimeout,
    Upstream,
    UpstreamConnectError,
    UpstreamTimeout,
    forward_headers,
    next_chunk,
    read_body,
    read_limited,
    response_headers,
)
from proxy.upstream.health import ActiveChecker, BackendHealth

log = logging.getLogger("kvroute.gateway")

_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
HIGH_FREE_FRACTION = 0.25
T = TypeVar("T")
_BROKEN = (aiohttp.ClientError, OSError, asyncio.IncompleteReadError)


@dataclass(slots=True)
class Outcome:
    """What happened to one request; feeds metrics and the diagnosis (fleet operations)."""

    request_id: str
    cls: RequestClass
    demand: int
    backend: str = ""
    attempts: int = 0
    outcome: str = "success"
    failed_on: list[str] = field(default_factory=list)
    retry_key: str | None = None
    failure: Response | None = None  # the answer if we stop now after an upstream failure


FailureHook = Callable[
    [str, str, int, float], None
]  # (backend or "", cause, demand, fleet free fraction)


class Gateway:
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
        self.admission = Admission(cfg.queue.max_size)
        self.urls = {b.name: b.base_url for b in cfg.backends}
        self.on_allocation_failure: list[FailureHook] = []
        self._bg: set[asyncio.Task[None]] = set()
        self.active = 0
        self.breaker = fleet.breaker
        self.health = BackendHealth([b.name for b in cfg.backends], cfg.health)
        self.budget = RetryBudget(cfg.retry.budget_percent, cfg.retry.budget_min_concurrency)
        self.ledger = ReservationLedger(
            store,
            self.breaker,
            cfg.store.reservation_ttl_s,
            on_error=lambda op: metrics.store_errors.labels(op).inc(),
        )
        # A store outage (failover) may have lost reservations the store acknowledged.
        fleet.on_degraded_change.append(self._store_lost)
        self.checker: ActiveChecker | None = None
        self.health.register(metrics.registry)
        metrics.registry.register(ResilienceCollector(self.breaker, self.budget, self.ledger))

    def _store_lost(self, degraded: bool) -> None:
        if degraded:
            self.ledger.mark_unsure()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the active health checks (needs the upstream session started)."""
        ac = self.cfg.health.active
        if ac.enabled and self.checker is None:
            path = ac.path if ac.path.startswith("/") else "/" + ac.path
            urls = {name: url + path for name, url in self.urls.items()}
            self.checker = ActiveChecker(self.health, urls, self._probe, ac.interval_s)
            self.checker.start()

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed backend list (discovery). URLs of removed backends are kept, so a
        request already placed on one still reaches it; probes cover the current list only."""
        self.cfg = cfg
        self.urls.update({b.name: b.base_url for b in cfg.backends})
        self.health.retain([b.name for b in cfg.backends])
        if self.checker is not None:
            path = cfg.health.active.path
            path = path if path.startswith("/") else "/" + path
            self.checker.urls = {b.name: b.base_url + path for b in cfg.backends}

    async def _probe(self, url: str) -> bool:
        status, _ = await self.upstream.get(url, self.cfg.health.active.timeout_s)
        return 200 <= status < 300

    async def close(self) -> None:
        """Shutdown: stop probing, let background work finish, release every reservation still held."""
        if self.checker is not None:
            await self.checker.stop()
            self.checker = None
        await self.drain_background()
        await self.ledger.close()

    # ---------------------------------------------------------------- helpers
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def drain_background(self) -> None:
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)

    async def _store_call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """A store call on the request path: through the breaker; StoreUnavailable counted and re-raised."""
        try:
            return await self.breaker.call(fn, op)
        except StoreUnavailable:
            self.metrics.store_errors.labels(op).inc()
            raise

    async def _store_quietly(self, op: str, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await self._store_call(op, fn)
        except StoreUnavailable:
            pass

    def _retry_key(self, request: Request, raw: bytes) -> str | None:
        key = request.headers.get("idempotency-key") or request.headers.get("x-request-id")
        if key:
            return key[:200]
        if self.cfg.retry.hash_body:
            return "body:" + hashlib.blake2b(raw, digest_size=16).hexdigest()
        return None

    def _max_capacity(self, snap: FleetSnapshot) -> int | None:
        caps = [b.capacity_tokens for b in self.cfg.backends if b.capacity_tokens is not None]
        caps += [n.report.capacity_tokens for n in snap.nodes if n.report is not None]
        return max(caps) if caps else None

    def _record_alloc_failure(
        self, backend: str, cause: str, demand: int, snap: FleetSnapshot
    ) -> None:
        cap = snap.total_capacity()
        free_frac = snap.total_free() / cap if cap else 0.0
        self.metrics.allocation_failures.labels(cause, backend or "none").inc()
        if free_frac > HIGH_FREE_FRACTION:
            self.metrics.failures_high_free.inc()
        for hook in self.on_allocation_failure:
            hook(backend, cause, demand, free_frac)

    def _cause_at_backend(
        self, verdict: UpstreamVerdict, demand: int, backend: str, snap: FleetSnapshot
    ) -> str:
        free = verdict.free_tokens
        if free is None:
            node = snap.by_name().get(backend)
            free = node.report.free_tokens if node is not None and node.report is not None else None
        return "fragmentation" if free is not None and free >= demand else "capacity"

    # ---------------------------------------------------------------- entry point
    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        t0 = time.perf_counter()
        rid = uuid.uuid4().hex  # reservation id: ours, never a client-chosen string
        client_rid = request.headers.get("x-request-id") or rid
        try:
            parsed = await self._read_and_parse(request, endpoint)
        except ApiError as err:
            self.metrics.rejected.labels(err.code or "invalid").inc()
            return err.response({"x-request-id": client_rid})
        self.active += 1
        self.metrics.active.inc()
        try:
            return await self._route(request, parsed, rid, client_rid, t0)
        except ApiError as err:
            return err.response({"x-request-id": client_rid})
        finally:
            self.active -= 1
            self.metrics.active.dec()

    async def _read_and_parse(self, request: Request, endpoint: Endpoint) -> ParsedRequest:
        limit = self.cfg.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(
                413,
                f"request body is {declared} bytes, above the limit of {limit}",
                code="request_too_large",
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413,
                    f"request body is above the limit of {limit} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)
        raw = b"".join(chunks)
        return parse_request(
            raw, endpoint, self.cfg.routing.max_tokens_limit, request.headers.get("content-type")
        )

    async def _route(
        self, request: Request, parsed: ParsedRequest, rid: str, client_rid: str, t0: float
    ) -> Response:
        rcfg = self.cfg.routing
        deadline = asyncio.get_running_loop().time() + self.cfg.upstream.total_timeout_s
        prompt_tokens = await count_prompt_async(
            parsed.body,
            rcfg.tokenize_in_thread_chars,
            rcfg.chat_tokens_per_message,
            rcfg.chat_tokens_reply_priming,
        )
        demand = prompt_tokens + (parsed.max_new_tokens or rcfg.default_max_tokens)
        cls = classify(demand, rcfg.long_threshold_tokens)
        snap = await self.fleet.snapshot()
        cap = self._max_capacity(snap)
        need = demand * (1.0 + rcfg.safety_margin) if self.policy.checks_fit else float(demand)
        if cap is not None and need > cap:
            raise ApiError(
                400,
                f"this request needs {demand} tokens of KV cache ({prompt_tokens} prompt + "
                f"{demand - prompt_tokens} max new), more than any backend holds ({cap}); shorten the prompt or lower max_tokens",
                param="messages" if parsed.endpoint == "chat" else "prompt",
                code="context_length_exceeded",
            )
        key = self._retry_key(request, parsed.raw)
        exclude: set[str] = set()
        if key is not None:
            try:
                exclude |= await self._store_call("failed_on", lambda: self.store.failed_on(key))
            except StoreUnavailable:
                pass
        out = Outcome(request_id=client_rid, cls=cls, demand=demand, retry_key=key)
        headers = forward_headers(request.headers)
        decided = False
        queue_deadline: float | None = None
        retries = 0
        try:
            while out.attempts < self.cfg.retry.max_attempts:
                avoid = frozenset(exclude) | self.health.avoid()
                now = self.clock()
                ranked = self.policy.rank(snap, RouteRequest(demand, cls, avoid), now)
                if not decided:
                    self.metrics.decision.observe(time.perf_counter() - t0)
                    decided = True
                if ranked and out.failure is not None:
                    # A retry of a failed attempt: only within the budget.
                    if not self.budget.try_acquire(self.active):
                        self.metrics.retries.labels("budget_exhausted").inc()
                        return out.failure
                    retries += 1
                backend = await self._reserve_first(ranked, rid, demand, now)
                if backend is None:
                    if out.failure is not None:
                        return (
                            out.failure
                        )  # no other backend can serve: the last failure is the answer
                    if queue_deadline is None:
                        queue_deadline = time.monotonic() + self.cfg.queue.max_wait_s
                    waited = await self._wait_for_fit(demand, cls, avoid, queue_deadline)
                    if waited is None:
                        return self._nothing_fits(out, snap, exclude, exhausted=out.attempts > 0)
                    snap = waited
                    continue
                out.attempts += 1
                if out.attempts > 1:
                    self.metrics.retries.labels(
                        "upstream_failure" if out.failure is not None else "diverted"
                    ).inc()
                out.failure = None
                result = await self._attempt(
                    request, parsed, backend, rid, headers, out, snap, deadline
                )
                if result is not None:
                    return result
                exclude.add(backend)
                snap = await self.fleet.snapshot()
            return (
                out.failure
                if out.failure is not None
                else self._nothing_fits(out, snap, exclude, exhausted=True)
            )
        finally:
            self.budget.release(retries)

    def _failed(self, out: Outcome, backend: str) -> None:
        """This attempt failed on `backend`: the client's own retry (same key) must not go back there."""
        out.failed_on.append(backend)
        if out.retry_key is not None:
            key = out.retry_key
            self._spawn(
                self._store_quietly(
                    "add_failed",
                    lambda: self.store.add_failed(key, backend, self.cfg.retry.retry_key_ttl_s),
                )
            )

    async def _reserve_first(
        self, ranked: list[str], rid: str, demand: int, now: float
    ) -> str | None:
        """Reserve on the best candidate that accepts; a lost race moves on to the next."""
        # After a store outage, first tell the store what this gateway already placed.
        await self.ledger.reassert()
        for name in ranked:
            try:
                reserve = functools.partial(
                    self.store.reserve,
                    name,
                    rid,
                    demand,
                    now,
                    self.cfg.store.reservation_ttl_s,
                    check_fit=self.policy.checks_fit,
                    headroom=self.cfg.routing.safety_margin,
                    grace_s=self.cfg.store.report_grace_s,
                )
                ok = await self._store_call("reserve", reserve)
            except StoreUnavailable:
                # The reserve may still land (a paused store): release it later; and re-assert
                # it once the store answers, in case it did not.
                self.ledger.hold(name, rid, demand, now)
                self.ledger.mark_unsure()
                return name  # degraded: route without a shared reservation rather than fail
            if ok:
                self.ledger.hold(name, rid, demand, now)
                return name
        return None

    async def _wait_for_fit(
        self, demand: int, cls: RequestClass, exclude: frozenset[str], deadline: float
    ) -> FleetSnapshot | None:
        """The admission queue: wait (bounded) for a report that shows a big enough block."""
        if time.monotonic() >= deadline or not self.admission.try_enter():
            return None
        self.metrics.queue_depth.set(self.admission.depth)
        start = time.monotonic()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                await self.admission.wait(min(remaining, 0.05))
                snap = await self.fleet.snapshot(force=True)
                if self.policy.rank(
                    snap, RouteRequest(demand, cls, exclude | self.health.avoid()), self.clock()
                ):
                    return snap
        finally:
            self.admission.leave()
            self.metrics.queue_depth.set(self.admission.depth)
            self.metrics.queue_wait.observe(time.monotonic() - start)

    def _nothing_fits(
        self, out: Outcome, snap: FleetSnapshot, exclude: set[str], exhausted: bool = False
    ) -> Response:
        cause, why = nothing_fits_reason(snap, out.demand, self.clock())
        if exhausted and out.failed_on:
            why = f"tried {', '.join(out.failed_on)}: all failed to allocate; " + why
        self._record_alloc_failure("", cause, out.demand, snap)
        self.metrics.requests.labels(out.cls, "none", "no_fit").inc()
        ra = str(self.cfg.queue.retry_after_s)
        err = ApiError(
            503,
            why,
            type="kv_cache_unavailable",
            code=f"no_backend_fits_{cause}",
            headers={"retry-after": ra},
            extra={"cause": cause, "demand_tokens": out.demand},
        )
        return err.response(self._kv_headers(out, out.backend or "none"))

    def _kv_headers(self, out: Outcome, backend: str) -> dict[str, str]:
        return {
            "x-kvroute-backend": backend,
            "x-kvroute-class": out.cls,
            "x-kvroute-demand-tokens": str(out.demand),
            "x-kvroute-attempts": str(out.attempts),
            "x-request-id": out.request_id,
        }

    # ---------------------------------------------------------------- one attempt
    def _upstream_failed(
        self, out: Outcome, backend: str, rid: str, answer: Response, result: str, why: str
    ) -> None:
        """An attempt failed before any byte reached the client: eject-count it, remember the answer, divert."""
        self._spawn(self.ledger.release(backend, rid))
        self.metrics.attempts.labels(backend, result).inc()
        self.health.failure(backend)
        self._failed(out, backend)
        log.warning("request %s: %s failed (%s): %s", out.request_id, backend, result, why)
        answer.headers.update(self._kv_headers(out, backend))
        out.failure = answer
        self.metrics.requests.labels(out.cls, backend, "upstream_error").inc()

    @staticmethod
    def _gateway_error(status: int, message: str, code: str) -> Response:
        return ApiError(status, message, type="upstream_error", code=code).response()

    def _bad_answer(
        self,
        resp: aiohttp.ClientResponse,
        out: Outcome,
        backend: str,
        rid: str,
        status: int,
        code: str,
        result: str,
        msg: str,
    ) -> None:
        """The backend's answer broke before reaching the client: drop its connection and divert."""
        resp.close()
        self._upstream_failed(
            out, backend, rid, self._gateway_error(status, msg, code), result, msg
        )

    async def _attempt(
        self,
        request: Request,
        parsed: ParsedRequest,
        backend: str,
        rid: str,
        headers: dict[str, str],
        out: Outcome,
        snap: FleetSnapshot,
        deadline: float,
    ) -> Response | None:
        """Forward to `backend`. A Response ends the request; None means divert to another node."""
        url = self.urls[backend] + _PATHS[parsed.endpoint]
        loop = asyncio.get_running_loop()
        t_start = time.perf_counter()
        ttfb_deadline = min(loop.time() + self.cfg.upstream.ttfb_timeout_s, deadline)
        try:
            resp = await self.upstream.post(url, parsed.raw, headers, ttfb_deadline - loop.time())
        except UpstreamTimeout as exc:
            code = "upstream_connect_timeout" if exc.phase == "connect" else "upstream_timeout"
            self._upstream_failed(
                out,
                backend,
                rid,
                self._gateway_error(504, f"backend {backend} did not answer: {exc}", code),
                "timeout",
                str(exc),
            )
            return None
        except UpstreamConnectError as exc:
            msg = f"backend {backend} could not be reached: {exc}"
            self._upstream_failed(
                out,
                backend,
                rid,
                self._gateway_error(502, msg, "upstream_unavailable"),
                "connect_error",
                str(exc),
            )
            return None
        except BaseException:
            self._spawn(self.ledger.release(backend, rid))
            raise
        try:
            if resp.status >= 400:
                return await self._error_answer(resp, backend, rid, out, snap)
            if parsed.stream and resp.headers.get("content-type", "").lower().startswith(
                "text/event-stream"
            ):
                return await self._start_stream(
                    resp, backend, rid, out, t_start, ttfb_deadline, deadline
                )
            return await self._whole_answer(resp, backend, rid, out, t_start, deadline)
        except BaseException:
            resp.close()
            self._spawn(self.ledger.release(backend, rid))
            raise

    async def _error_answer(
        self,
        resp: aiohttp.ClientResponse,
        backend: str,
        rid: str,
        out: Outcome,
        snap: FleetSnapshot,
    ) -> Response | None:
        try:
            async with asyncio.timeout(self.cfg.upstream.idle_timeout_s):
                body = await read_limited(resp)
        except (*_BROKEN, TimeoutError):
            body = b""
        finally:
            resp.close()
        verdict = classify_response(resp.status, body, resp.headers.get("retry-after"))
        if verdict.verdict == "client_error":
            self.metrics.attempts.labels(backend, verdict.verdict).inc()
            self.health.success(backend)
            await self.ledger.release(backend, rid)
            self.metrics.requests.labels(out.cls, backend, "rejected").inc()
            h = response_headers(resp.headers)
            h.update(self._kv_headers(out, backend))
            return Response(body, status_code=resp.status, headers=h)
        if verdict.retry_after_s is not None and verdict.retry_after_s > 0:
            self._cool_down(backend, verdict.retry_after_s)
        relay_body = body if is_json_object(body) else None
        if verdict.verdict == "allocation":
            self.metrics.attempts.labels(backend, verdict.verdict).inc()
            self.health.success(backend)  # alive and answering: not a fault, just full
            self._spawn(self.ledger.release(backend, rid))
            self._failed(out, backend)
            cause = self._cause_at_backend(verdict, out.demand, backend, snap)
            self._record_alloc_failure(backend, cause, out.demand, snap)
            self._spawn(self._learn_ceiling(backend, out.demand, self.clock()))
            log.info(
                "request %s: %s could not allocate %d tokens (%s); diverting",
                rid,
                backend,
                out.demand,
                cause,
            )
            if out.attempts >= self.cfg.retry.max_attempts:
                self.metrics.requests.labels(out.cls, backend, "allocation_failure").inc()
                h = {
                    k: v
                    for k, v in response_headers(resp.headers).items()
                    if k.lower() == "retry-after"
                }
                h.update(self._kv_headers(out, backend))
                return Response(
                    body, status_code=resp.status, headers=h, media_type="application/json"
                )
            return None
        # overload (429/503) or another 5xx: a failure of this backend; another may serve.
        h = {k: v for k, v in response_headers(resp.headers).items() if k.lower() == "retry-after"}
        if relay_body is not None:
            answer = Response(
                relay_body, status_code=resp.status, headers=h, media_type="application/json"
            )
        else:
            status = resp.status if resp.status in (429, 503) else 502
            err = ApiError(
                status,
                f"backend {backend} answered HTTP {resp.status}",
                type="upstream_error",
                code="upstream_server_error",
                headers=h,
            )
            answer = err.response()
        if resp.status >= 500:
            self._upstream_failed(out, backend, rid, answer, verdict.verdict, f"HTTP {resp.status}")
        else:  # 429: busy, not broken; no ejection, but still try another
            self._spawn(self.ledger.release(backend, rid))
            self.metrics.attempts.labels(backend, verdict.verdict).inc()
            self._failed(out, backend)
            answer.headers.update(self._kv_headers(out, backend))
            out.failure = answer
        return None

    def _cool_down(self, backend: str, retry_after_s: float) -> None:
        """Honour a backend's Retry-After: no traffic from this replica (and, via the store, any) for a while."""
        seconds = min(retry_after_s, self.cfg.retry.max_retry_after_s)
        if seconds <= 0:
            return
        self.health.cooldown(backend, seconds)
        until = self.clock() + seconds
        self._spawn(
            self._store_quietly("set_cooldown", lambda: self.store.set_cooldown(backend, until))
        )

    async def _whole_answer(
        self,
        resp: aiohttp.ClientResponse,
        backend: str,
        rid: str,
        out: Outcome,
        t_start: float,
        deadline: float,
    ) -> Response | None:
        """A non-streamed 2xx: read it all (nothing reached the client yet, so a failure may still divert)."""
        try:
            body = await read_body(resp, self.cfg.upstream.idle_timeout_s, deadline)
        except BodyTimeout as exc:
            self._bad_answer(
                resp,
                out,
                backend,
                rid,
                504,
                f"upstream_{exc.phase}_timeout",
                "timeout",
                f"backend {backend} stopped answering: {exc}",
            )
            return None
        except _BROKEN as exc:
            self._bad_answer(
                resp,
                out,
                backend,
                rid,
                502,
                "upstream_broken",
                "broken",
                f"backend {backend} broke off its answer: {exc.__class__.__name__}",
            )
            return None
        resp.release()
        if not is_json_object(body):
            msg = f"backend {backend} sent an answer that is not a JSON object"
            self._upstream_failed(
                out,
                backend,
                rid,
                self._gateway_error(502, msg, "upstream_bad_response"),
                "garbage",
                msg,
            )
            return None
        self.metrics.attempts.labels(backend, "ok").inc()
        self.health.success(backend)
        out.backend = backend
        self._spawn(self.ledger.release(backend, rid))  # off the answer's path (a Redis round trip)
        self.metrics.requests.labels(out.cls, backend, "success").inc()
        self.metrics.duration.labels(out.cls).observe(time.perf_counter() - t_start)
        h = response_headers(resp.headers)
        h.update(self._kv_headers(out, backend))
        return Response(body, status_code=resp.status, headers=h)

    async def _start_stream(
        self,
        resp: aiohttp.ClientResponse,
        backend: str,
        rid: str,
        out: Outcome,
        t_start: float,
        ttfb_deadline: float,
        deadline: float,
    ) -> Response | None:
        """Wait for the first event before answering: until then a failure can still go to another backend."""
        loop = asyncio.get_running_loop()
        try:
            first = await next_chunk(resp, max(0.001, ttfb_deadline - loop.time()), deadline)
        except BodyTimeout as exc:
            self._bad_answer(
                resp,
                out,
                backend,
                rid,
                504,
                "upstream_timeout",
                "timeout",
                f"backend {backend} sent no first event in time: {exc}",
            )
            return None
        except _BROKEN as exc:
            self._bad_answer(
                resp,
                out,
                backend,
                rid,
                502,
                "upstream_broken",
                "broken",
                f"backend {backend} broke off before its first event: {exc.__class__.__name__}",
            )
            return None
        if not looks_like_sse(first):
            self._bad_answer(
                resp,
                out,
                backend,
                rid,
                502,
                "upstream_bad_response",
                "garbage",
                f"backend {backend} sent a stream that is not server-sent events",
            )
            return None
        self.metrics.attempts.labels(backend, "ok").inc()
        out.backend = backend
        h = response_headers(resp.headers)
        h.update(self._kv_headers(out, backend))
        state = {"outcome": "client_disconnect"}

        async def close() -> None:
            if state["outcome"] != "success":
                resp.close()  # drops the upstream connection: the backend sees the cancel
            else:
                resp.release()
            self.metrics.requests.labels(out.cls, backend, state["outcome"]).inc()
            self.metrics.duration.labels(out.cls).observe(time.perf_counter() - t_start)
            self._spawn(self.ledger.release(backend, rid))

        # RelayResponse runs close() even if the client left before the first chunk was pulled
        # (then the generator below never starts and its own finally would never run).
        on_close = OnceCallback(close)
        return RelayResponse(
            self._relay(resp, first, backend, rid, state, deadline, on_close),
            on_close,
            status_code=resp.status,
            headers=h,
            media_type=resp.headers.get("content-type", "text/event-stream"),
        )

    async def _learn_ceiling(self, backend: str, demand: int, now: float) -> None:
        until = now + self.cfg.retry.ceiling_ttl_s
        await self._store_quietly(
            "set_ceiling", lambda: self.store.set_ceiling(backend, demand, now, until)
        )

    async def _relay(
        self,
        resp: aiohttp.ClientResponse,
        first: bytes,
        backend: str,
        rid: str,
        state: dict[str, str],
        deadline: float,
        on_close: OnceCallback,
    ) -> AsyncIterator[bytes]:
        """Relay a stream; always release the reservation, and cancel upstream on client disconnect.

        Bytes already reached the client, so a failure here cannot be retried: the stream ends
        with a final SSE error event that names the cause (idle gap, total time, broken off).
        """
        idle = self.cfg.upstream.idle_timeout_s
        try:
            yield first
            while chunk := await next_chunk(resp, idle, deadline):
                yield chunk
            state["outcome"] = "success"
            self.health.success(backend)
        except BodyTimeout as exc:
            state["outcome"] = "upstream_timeout"
            if exc.phase == "idle":
                self.health.failure(backend)
            log.warning("request %s: stream from %s timed out (%s)", rid, backend, exc.phase)
            yield sse_error_event(f"backend {backend}: {exc}", code=f"upstream_{exc.phase}_timeout")
        except _BROKEN as exc:
            state["outcome"] = "upstream_error"
            self.health.failure(backend)
            log.warning(
                "request %s: stream from %s broke off: %s", rid, backend, exc.__class__.__name__
            )
            yield sse_error_event(
                f"backend {backend} stopped streaming ({exc.__class__.__name__})",
                code="upstream_stream_broken",
            )
        finally:
            await on_close()
