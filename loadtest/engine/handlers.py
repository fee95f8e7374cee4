"""The simulated engine's HTTP surface: the OpenAI routes, ``/metrics``, and the admin and fault endpoints.

A real OpenAI-compatible server (aiohttp.web) over the engine's model
(``loadtest.engine.model``). A request that cannot be placed fails at once with the
documented allocation error (HTTP 503, ``kv_cache_allocation_error``), so a long-running
engine shows exactly the problem's false capacity exhaustion. ``/metrics`` exports the
allocator gauges of ``proxy.core.backend_contract`` (and vLLM's names for a paged engine);
``/admin/*`` restarts the engine, injects faults and pins memory for tests.

Server: aiohttp.web on uvloop (``loadtest.engine.server``). Measured on this project's 2-CPU
box for tiny non-streaming POSTs (server and load generator pinned to one core each, six
alternating rounds): aiohttp + uvloop about 4,700 req/s median, Starlette on uvicorn
(httptools, uvloop) about 3,200, aiohttp on the default asyncio loop about 3,000. See
docs/engine.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from aiohttp import web

from loadtest.engine.metrics import EngineCollector, exposition
from loadtest.engine.model import (
    FAULT_MODES,
    FAULT_SCOPES,
    EngineConfig,
    EngineModel,
    EngineRestarted,
    LiveRequest,
)
from loadtest.engine.protocol import (
    SSE_DONE,
    BadRequest,
    Parsed,
    allocation_error_body,
    chunk,
    error_body,
    full_body,
    parse_body,
    sse,
    usage_chunk,
)
from proxy.core import backend_contract as contract
from proxy.gateway.sizing import count_prompt_async

log = logging.getLogger("kvroute.engine")

JSON = "application/json"


class Engine(EngineModel):
    """The engine's request handlers over its model; one per aiohttp app."""

    # --- HTTP handlers --------------------------------------------------------------------
    def _error(self, status: int, body: bytes) -> web.Response:
        return web.Response(status=status, body=body, content_type=JSON, headers=self._headers)

    async def _faulted(self, request: web.Request, inference: bool) -> web.StreamResponse | None:
        """The injected fault's answer, or None when this endpoint is not affected."""
        if self.fault == "none" or (not inference and self.fault_scope != "all"):
            return None
        if self.fault == "error500":
            return web.Response(status=500, text="Internal Server Error")
        if self.fault == "garbage":
            return web.Response(
                status=200, body=b"\x00\xffnot json {{{<html>garbage", content_type=JSON
            )
        # hang: accept, read, never answer, until the fault is cleared or the engine restarts;
        # then drop the connection the way a dying process would.
        await request.read()
        await self._hang_release.wait()
        if request.transport is not None:
            request.transport.close()
        return web.Response(status=503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=True)

    async def _infer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.fault != "none":
            faulted = await self._faulted(request, inference=True)
            if faulted is not None:
                return faulted
        self.lifetime_requests += 1
        try:
            body, p = self._parse(await request.read(), chat)
        except BadRequest as exc:
            self.outcomes["bad_request"] += 1
            return self._error(exc.status, error_body(exc.message, exc.type, exc.param, exc.code))
        self.waiting += 1
        try:
            prompt_tokens = await count_prompt_async(body)
        finally:
            self.waiting -= 1
        refusal = self.context_refusal(prompt_tokens, p.max_tokens, chat)
        if refusal is not None:
            return self._error(400, refusal)
        demand = prompt_tokens + p.max_tokens
        live = self.admit(demand)
        if live is None:
            alloc = self.allocator
            body_bytes = allocation_error_body(
                demand, alloc.free_tokens, alloc.largest_free_block_tokens, alloc.kind
            )
            return self._error(contract.ALLOCATION_ERROR_STATUS, body_bytes)
        return await self._generate(request, live, p, prompt_tokens)

    def _parse(self, raw: bytes, chat: bool) -> tuple[Any, Parsed]:
        """The request's body and what the engine reads of it; BadRequest when unusable."""
        cfg = self.config
        body, p = parse_body(raw, chat, cfg.default_max_tokens)
        if cfg.strict_model and p.model != cfg.model:
            raise BadRequest(
                f"The model `{p.model}` does not exist.",
                "model",
                "model_not_found",
                404,
                "NotFoundError",
            )
        return body, p

    async def _generate(
        self, request: web.Request, live: LiveRequest, p: Parsed, prompt_tokens: int
    ) -> web.StreamResponse:
        """Prefill and decode in simulated time: a whole answer, or a stream."""
        outcome = "cancelled"
        try:
            if p.stream:
                resp, outcome = await self._stream(request, live, p, prompt_tokens)
                return resp
            await self._sleep(
                live, self._prefill_s(prompt_tokens) + p.max_tokens * self._per_token_s
            )
            outcome = "ok"
            return web.Response(
                body=full_body(
                    self._completion_id(p, live.request_no),
                    int(time.time()),
                    p,
                    self._text(live.request_no, 0, p.max_tokens),
                    prompt_tokens,
                ),
                content_type=JSON,
                headers=self._headers,
            )
        except EngineRestarted:
            outcome = "restarted"
            return self._error(503, self._restarted_body())
        finally:
            self.finish(live, outcome)

    async def _stream(
        self, request: web.Request, live: LiveRequest, p: Parsed, prompt_tokens: int
    ) -> tuple[web.StreamResponse, str]:
        resp = web.StreamResponse(
            headers={
                **self._headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
        )
        await resp.prepare(request)
        completion_id = self._completion_id(p, live.request_no)
        created = int(time.time())
        loop = asyncio.get_running_loop()
        try:
            await self._sleep(live, self._prefill_s(prompt_tokens))
            t0 = loop.time()
            if p.chat:
                await resp.write(chunk(completion_id, created, p, None, None, role=True))
            sent = 0
            total = p.max_tokens
            per = self._per_token_s
            while sent < total:
                k = min(self._tokens_per_chunk, total - sent)
                await self._sleep(live, t0 + (sent + k) * per - loop.time())
                text = self._text(live.request_no, sent, k)
                sent += k
                await resp.write(
                    chunk(completion_id, created, p, text, "length" if sent == total else None)
                )
            if p.include_usage:
                await resp.write(usage_chunk(completion_id, created, p, prompt_tokens))
            await resp.write(SSE_DONE)
            await resp.write_eof()
            return resp, "ok"
        except EngineRestarted:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await resp.write(sse(orjson.loads(self._restarted_body())))
                await resp.write_eof()
            return resp, "restarted"
        except (ConnectionError, RuntimeError):
            return resp, "cancelled"  # the client went away mid-stream

    async def models(self, request: web.Request) -> web.StreamResponse:
        if self.fault != "none" and (faulted := await self._faulted(request, False)) is not None:
            return faulted
        cfg = self.config
        return web.Response(
            body=orjson.dumps(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": cfg.model,
                            "object": "model",
                            "created": int(self.started_at),
                            "owned_by": "kvroute-sim",
                            "root": cfg.model,
                            "max_model_len": self.allocator.capacity_tokens,
                        }
                    ],
                }
            ),
            content_type=JSON,
            headers=self._headers,
        )

    async def health(self, request: web.Request) -> web.StreamResponse:
        if self.fault != "none" and (faulted := await self._faulted(request, False)) is not None:
            return faulted
        return web.Response(body=b'{"status":"ok"}', content_type=JSON, headers=self._headers)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        if self.fault != "none" and (faulted := await self._faulted(request, False)) is not None:
            return faulted
        data, content_type = exposition(request.app[REGISTRY_KEY])
        resp = web.Response(body=data, headers=self._headers)
        resp.headers["Content-Type"] = content_type
        return resp

    # --- admin ------------------------------------------------------------------------------
    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            return {}
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise BadRequest("request body is not valid JSON", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise BadRequest("request body must be a JSON object", None, "invalid_type")
        return data

    def _ok(self, obj: Any) -> web.Response:
        return web.Response(body=orjson.dumps(obj), content_type=JSON, headers=self._headers)

    async def admin_restart(self, request: web.Request) -> web.StreamResponse:
        failed = self.restart()
        log.info("engine %s restarted (%d in-flight requests failed)", self.config.name, failed)
        return self._ok(
            {"restarted": True, "failed_in_flight": failed, "started_at": self.started_at}
        )

    async def admin_fault(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return self._ok({"mode": self.fault, "scope": self.fault_scope})
        try:
            data = await self._json_body(request)
            mode = data.get("mode")
            scope = data.get("scope", "inference")
            if not isinstance(mode, str) or mode not in FAULT_MODES:
                raise BadRequest(
                    f"mode must be one of {list(FAULT_MODES)}", "mode", "invalid_value"
                )
            if not isinstance(scope, str) or scope not in FAULT_SCOPES:
                raise BadRequest(
                    f"scope must be one of {list(FAULT_SCOPES)}", "scope", "invalid_value"
                )
        except BadRequest as exc:
            return self._error(400, error_body(exc.message, exc.type, exc.param, exc.code))
        self.set_fault(mode, scope)
        return self._ok({"mode": self.fault, "scope": self.fault_scope})

    async def admin_state(self, request: web.Request) -> web.StreamResponse:
        state = self.figures()
        if request.query.get("gaps") in ("1", "true"):
            state["gap_list"] = self.allocator.gaps()
        return self._ok(state)

    async def admin_hold(self, request: web.Request) -> web.StreamResponse:
        """Pin memory outside any request (tests build a fragmented engine this way)."""
        try:
            data = await self._json_body(request)
            tokens = data.get("tokens")
            count = data.get("count", 1)
            if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
                raise BadRequest("tokens must be a positive integer", "tokens", "invalid_value")
            if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 100_000:
                raise BadRequest(
                    "count must be an integer within 1..100000", "count", "invalid_value"
                )
        except BadRequest as exc:
            return self._error(400, error_body(exc.message, exc.type, exc.param, exc.code))
        held, failed = self.hold(tokens, count)
        return self._ok({"held": held, "failed": failed, **self._memory()})

    async def admin_release(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._json_body(request)
            every = bool(data.get("all"))
            ids = data.get("ids")
            if not every and (
                not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)
            ):
                raise BadRequest(
                    "give ids (a list of hold ids) or all: true", "ids", "invalid_value"
                )
        except BadRequest as exc:
            return self._error(400, error_body(exc.message, exc.type, exc.param, exc.code))
        released = self.release(None if every else ids)
        return self._ok({"released": released, **self._memory()})


ENGINE_KEY = web.AppKey("engine", Engine)
REGISTRY_KEY: web.AppKey[Any] = web.AppKey("registry")


def build_app(config: EngineConfig) -> web.Application:
    """The aiohttp application for one engine (several can live in one process)."""
    from prometheus_client import CollectorRegistry

    engine = Engine(config)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    app[ENGINE_KEY] = engine
    app[REGISTRY_KEY] = registry
    r = app.router
    r.add_post("/v1/completions", engine.completions)
    r.add_post("/v1/chat/completions", engine.chat_completions)
    r.add_get("/v1/models", engine.models)
    r.add_get("/health", engine.health)
    r.add_get("/metrics", engine.metrics)
    r.add_post("/admin/restart", engine.admin_restart)
    r.add_post("/admin/fault", engine.admin_fault)
    r.add_get("/admin/fault", engine.admin_fault)
    r.add_get("/admin/state", engine.admin_state)
    r.add_post("/admin/hold", engine.admin_hold)
    r.add_post("/admin/release", engine.admin_release)
    return app
