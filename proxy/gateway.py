"""One request through the gateway: size, classify, rank, reserve, forward, divert, release.

This module orchestrates; the decisions live in pure modules (``tokens``, ``policy``,
``upstream_errors``) and the I/O in ``forward`` and the state store.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from proxy.admission import Admission
from proxy.config import Config
from proxy.errors import ApiError, sse_error_event
from proxy.fleet import FleetSnapshot
from proxy.fleet_cache import FleetCache
from proxy.forward import (
    Upstream,
    UpstreamConnectError,
    UpstreamTimeout,
    forward_headers,
    iter_body,
    read_limited,
    response_headers,
)
from proxy.metrics import GatewayMetrics
from proxy.policy import Policy, RequestClass, RouteRequest, classify, nothing_fits_reason
from proxy.state.base import StateStore, StoreUnavailable
from proxy.tokens import count_prompt_async
from proxy.upstream_errors import UpstreamVerdict, classify_response
from proxy.validation import Endpoint, ParsedRequest, parse_request

log = logging.getLogger("kvroute.gateway")

_PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
HIGH_FREE_FRACTION = 0.25


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


FailureHook = Callable[[str, str, int, float], None]  # (backend or "", cause, demand, fleet free fraction)


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

    # ---------------------------------------------------------------- helpers
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def drain_background(self) -> None:
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)

    async def _release(self, backend: str, rid: str) -> None:
        try:
            await self.store.release(backend, rid)
        except StoreUnavailable:
            self.metrics.store_errors.labels("release").inc()  # the reservation expires on its own

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

    def _record_alloc_failure(self, backend: str, cause: str, demand: int, snap: FleetSnapshot) -> None:
        cap = snap.total_capacity()
        free_frac = snap.total_free() / cap if cap else 0.0
        self.metrics.allocation_failures.labels(cause, backend or "none").inc()
        if free_frac > HIGH_FREE_FRACTION:
            self.metrics.failures_high_free.inc()
        for hook in self.on_allocation_failure:
            hook(backend, cause, demand, free_frac)

    def _cause_at_backend(self, verdict: UpstreamVerdict, demand: int, backend: str, snap: FleetSnapshot) -> str:
        free = verdict.free_tokens
        if free is None:
            node = snap.by_name().get(backend)
            free = node.report.free_tokens if node is not None and node.report is not None else None
        return "fragmentation" if free is not None and free >= demand else "capacity"

    # ---------------------------------------------------------------- entry point
    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        t0 = time.perf_counter()
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            parsed = await self._read_and_parse(request, endpoint)
        except ApiError as err:
            self.metrics.rejected.labels(err.code or "invalid").inc()
            return err.response({"x-request-id": rid})
        self.active += 1
        self.metrics.active.inc()
        try:
            return await self._route(request, parsed, rid, t0)
        except ApiError as err:
            return err.response({"x-request-id": rid})
        finally:
            self.active -= 1
            self.metrics.active.dec()

    async def _read_and_parse(self, request: Request, endpoint: Endpoint) -> ParsedRequest:
        limit = self.cfg.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body is {declared} bytes, above the limit of {limit}", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body is above the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        return parse_request(raw, endpoint, self.cfg.routing.max_tokens_limit, request.headers.get("content-type"))

    async def _route(self, request: Request, parsed: ParsedRequest, rid: str, t0: float) -> Response:
        rcfg = self.cfg.routing
        prompt_tokens = await count_prompt_async(
            parsed.body, rcfg.tokenize_in_thread_chars, rcfg.chat_tokens_per_message, rcfg.chat_tokens_reply_priming
        )
        demand = prompt_tokens + (parsed.max_new_tokens or rcfg.default_max_tokens)
        cls = classify(demand, rcfg.long_threshold_tokens)
        snap = await self.fleet.snapshot()
        cap = self._max_capacity(snap)
        if cap is not None and demand > cap:
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
                exclude |= await self.store.failed_on(key)
            except StoreUnavailable:
                self.metrics.store_errors.labels("failed_on").inc()
        out = Outcome(request_id=rid, cls=cls, demand=demand, retry_key=key)
        headers = forward_headers(request.headers)
        decided = False
        queue_deadline: float | None = None
        budget = self.cfg.retry.max_attempts
        while out.attempts < budget:
            now = self.clock()
            ranked = self.policy.rank(snap, RouteRequest(demand, cls, frozenset(exclude)), now)
            if not decided:
                self.metrics.decision.observe(time.perf_counter() - t0)
                decided = True
            backend = await self._reserve_first(ranked, rid, demand, now)
            if backend is None:
                if queue_deadline is None:
                    queue_deadline = time.monotonic() + self.cfg.queue.max_wait_s
                waited = await self._wait_for_fit(demand, cls, exclude, queue_deadline)
                if waited is None:
                    return self._nothing_fits(out, snap, exclude, exhausted=out.attempts > 0)
                snap = waited
                continue
            out.attempts += 1
            if out.attempts > 1:
                self.metrics.retries.labels("diverted").inc()
            result = await self._attempt(request, parsed, backend, rid, headers, out, snap)
            if result is not None:
                return result
            exclude.add(backend)
            snap = await self.fleet.snapshot()
        return self._nothing_fits(out, snap, exclude, exhausted=True)

    def _failed(self, out: Outcome, backend: str) -> None:
        """This attempt failed on `backend`: the client's own retry (same key) must not go back there."""
        out.failed_on.append(backend)
        if out.retry_key is not None:
            self._spawn(self._remember_failure(out.retry_key, backend))

    async def _remember_failure(self, key: str, backend: str) -> None:
        try:
            await self.store.add_failed(key, backend, self.cfg.retry.retry_key_ttl_s)
        except StoreUnavailable:
            self.metrics.store_errors.labels("add_failed").inc()

    async def _reserve_first(self, ranked: list[str], rid: str, demand: int, now: float) -> str | None:
        """Reserve on the best candidate that accepts; a lost race moves on to the next."""
        for name in ranked:
            try:
                ok = await self.store.reserve(
                    name,
                    rid,
                    demand,
                    now,
                    self.cfg.store.reservation_ttl_s,
                    check_fit=self.policy.checks_fit,
                    headroom=self.cfg.routing.safety_margin,
                    grace_s=self.cfg.store.report_grace_s,
                )
            except StoreUnavailable:
                self.metrics.store_errors.labels("reserve").inc()
                return name  # degraded: route without a shared reservation rather than fail
            if ok:
                return name
        return None

    async def _wait_for_fit(self, demand: int, cls: RequestClass, exclude: set[str], deadline: float) -> FleetSnapshot | None:
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
                if self.policy.rank(snap, RouteRequest(demand, cls, frozenset(exclude)), self.clock()):
                    return snap
        finally:
            self.admission.leave()
            self.metrics.queue_depth.set(self.admission.depth)
            self.metrics.queue_wait.observe(time.monotonic() - start)

    def _nothing_fits(self, out: Outcome, snap: FleetSnapshot, exclude: set[str], exhausted: bool = False) -> Response:
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
    async def _attempt(
        self,
        request: Request,
        parsed: ParsedRequest,
        backend: str,
        rid: str,
        headers: dict[str, str],
        out: Outcome,
        snap: FleetSnapshot,
    ) -> Response | None:
        """Forward to `backend`. A Response ends the request; None means divert to another node."""
        url = self.urls[backend] + _PATHS[parsed.endpoint]
        t_start = time.perf_counter()
        try:
            resp = await self.upstream.post(url, parsed.raw, headers)
        except (UpstreamConnectError, UpstreamTimeout) as exc:
            self._spawn(self._release(backend, rid))
            self.metrics.attempts.labels(backend, "timeout" if isinstance(exc, UpstreamTimeout) else "connect_error").inc()
            self._failed(out, backend)
            log.warning("request %s: %s failed: %s", rid, backend, exc)
            if out.attempts >= self.cfg.retry.max_attempts:
                self.metrics.requests.labels(out.cls, backend, "upstream_error").inc()
                status = 504 if isinstance(exc, UpstreamTimeout) else 502
                raise ApiError(status, f"backend {backend} did not answer: {exc}", type="upstream_error", code="upstream_unavailable") from None
            return None

        if resp.status >= 400:
            try:
                body = await read_limited(resp)
            except (aiohttp.ClientError, TimeoutError):
                body = b""
            finally:
                resp.release()
            verdict = classify_response(resp.status, body, resp.headers.get("retry-after"))
            self.metrics.attempts.labels(backend, verdict.verdict).inc()
            if verdict.verdict == "client_error":
                await self._release(backend, rid)
                self.metrics.requests.labels(out.cls, backend, "rejected").inc()
                h = response_headers(resp.headers)
                h.update(self._kv_headers(out, backend))
                return Response(body, status_code=resp.status, headers=h)
            await self._release(backend, rid)
            self._failed(out, backend)
            if verdict.verdict == "allocation":
                cause = self._cause_at_backend(verdict, out.demand, backend, snap)
                self._record_alloc_failure(backend, cause, out.demand, snap)
                now = self.clock()
                self._spawn(self._learn_ceiling(backend, out.demand, now))
                log.info("request %s: %s could not allocate %d tokens (%s); diverting", rid, backend, out.demand, cause)
            if out.attempts >= self.cfg.retry.max_attempts:
                outcome = "allocation_failure" if verdict.verdict == "allocation" else "upstream_error"
                self.metrics.requests.labels(out.cls, backend, outcome).inc()
                h = {k: v for k, v in response_headers(resp.headers).items() if k.lower() == "retry-after"}
                h.update(self._kv_headers(out, backend))
                return Response(body, status_code=resp.status, headers=h, media_type="application/json")
            return None

        self.metrics.attempts.labels(backend, "ok").inc()
        out.backend = backend
        h = response_headers(resp.headers)
        h.update(self._kv_headers(out, backend))
        if parsed.stream:
            return StreamingResponse(
                self._relay(resp, backend, rid, out, t_start),
                status_code=resp.status,
                headers=h,
                media_type=resp.headers.get("content-type", "text/event-stream"),
            )
        try:
            async with asyncio.timeout(self.cfg.upstream.total_timeout_s):
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            resp.close()
            await self._release(backend, rid)
            self.metrics.requests.labels(out.cls, backend, "upstream_error").inc()
            raise ApiError(502, f"backend {backend} broke off its answer: {exc.__class__.__name__}", type="upstream_error", code="upstream_broken") from None
        await self._release(backend, rid)
        self.metrics.requests.labels(out.cls, backend, "success").inc()
        self.metrics.duration.labels(out.cls).observe(time.perf_counter() - t_start)
        return Response(body, status_code=resp.status, headers=h)

    async def _learn_ceiling(self, backend: str, demand: int, now: float) -> None:
        try:
            await self.store.set_ceiling(backend, demand, now, now + self.cfg.retry.ceiling_ttl_s)
        except StoreUnavailable:
            self.metrics.store_errors.labels("set_ceiling").inc()

    async def _relay(self, resp: aiohttp.ClientResponse, backend: str, rid: str, out: Outcome, t_start: float) -> AsyncIterator[bytes]:
        """Relay a stream; always release the reservation, and cancel upstream on client disconnect."""
        outcome = "client_disconnect"
        try:
            async with asyncio.timeout(self.cfg.upstream.total_timeout_s):
                async for chunk in iter_body(resp):
                    yield chunk
            outcome = "success"
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = "upstream_error"
            log.warning("request %s: stream from %s broke off: %s", rid, backend, exc.__class__.__name__)
            yield sse_error_event(f"backend {backend} stopped streaming ({exc.__class__.__name__})", code="upstream_stream_broken")
        finally:
            if outcome != "success":
                resp.close()  # drops the upstream connection: the backend sees the cancel
            else:
                resp.release()
            self.metrics.requests.labels(out.cls, backend, outcome).inc()
            self.metrics.duration.labels(out.cls).observe(time.perf_counter() - t_start)
            task = asyncio.ensure_future(self._release(backend, rid))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)
