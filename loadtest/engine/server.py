"""A simulated inference engine whose KV cache fragments: a real OpenAI-compatible HTTP server.

Each request reserves ``prompt + max_tokens`` tokens in a contiguous first-fit or a paged
allocator for its whole life and gives them back when it ends, fails, or its client goes
away. A request that cannot be placed fails at once with the documented allocation error
(HTTP 503, ``kv_cache_allocation_error``), so a long-running engine shows exactly the
problem's false capacity exhaustion. Time is simulated: prefill and decode take
``tokens / rate / speedup`` seconds. ``/metrics`` exports the allocator gauges of
``proxy.core.backend_contract`` (and vLLM's names for a paged engine); ``/admin/*`` restarts
the engine, injects faults and pins memory for tests.

Server: aiohttp.web on uvloop. Measured on this project's 2-CPU box for tiny non-streaming
POSTs (server and load generator pinned to one core each, six alternating rounds): aiohttp +
uvloop about 4,700 req/s median, Starlette on uvicorn (httptools, uvloop) about 3,200,
aiohttp on the default asyncio loop about 3,000. See docs/engine.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import math
import random
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from loadtest.engine.allocators import ContiguousAllocator, PagedAllocator, make_allocator
from loadtest.engine.behaviours import disaggregation
from loadtest.engine.metrics import EngineCollector, exposition
from loadtest.engine.protocol import (
    SSE_DONE,
    BadRequest,
    Parsed,
    allocation_error_body,
    chunk,
    error_body,
    full_body,
    generated_text,
    parse_body,
    sse,
    usage_chunk,
)
from proxy.core import backend_contract as contract
from proxy.core.tokens import encoding
from proxy.gateway.sizing import count_prompt_async

if TYPE_CHECKING:
    from loadtest.engine.behaviours import BehaviourConfig

log = logging.getLogger("kvroute.engine")

FAULT_MODES = ("none", "hang", "garbage", "error500")
FAULT_SCOPES = ("inference", "all")
RESTARTED_TYPE = "engine_restarted"
JSON = "application/json"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine process is started with (the CLI flags, one for one)."""

    name: str = "engine"
    host: str = "127.0.0.1"
    port: int = 8101
    model: str = "sim-model"
    allocator: str = "contiguous"
    capacity_tokens: int = 100_000
    block_size: int = 16
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    speedup: float = 1.0
    default_max_tokens: int = 256
    seed: int = 0
    chunk_interval_s: float = 0.02
    strict_model: bool = False
    uvloop: bool = True

    def __post_init__(self) -> None:
        if self.allocator not in ("contiguous", "paged"):
            raise ValueError(f"allocator must be 'contiguous' or 'paged', got {self.allocator!r}")
        positive = {
            "capacity_tokens": self.capacity_tokens,
            "block_size": self.block_size,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "speedup": self.speedup,
            "default_max_tokens": self.default_max_tokens,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"{key} must be positive, got {value}")
        if self.chunk_interval_s < 0:
            raise ValueError(f"chunk_interval_s must be >= 0, got {self.chunk_interval_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {self.port}")


class EngineRestarted(Exception):
    """Raised inside an in-flight request when /admin/restart empties the allocator under it."""


@dataclass(slots=True, eq=False)
class _Live:
    request_no: int
    waiter: asyncio.Future[None] | None = None
    restarted: bool = False


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


OUTCOMES = (
    "ok",
    "allocation_failed",
    "context_length_exceeded",
    "bad_request",
    "cancelled",
    "restarted",
)


class Engine:
    """The engine's state and request handlers; one per aiohttp app."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.allocator: ContiguousAllocator | PagedAllocator = make_allocator(
            config.allocator, config.capacity_tokens, config.block_size
        )
        self.started_at = time.time()
        self.restarts = 0
        self.running = 0
        self.waiting = 0
        self.allocation_failures = 0  # since the last (re)start, like a process's counter
        self.outcomes = dict.fromkeys(OUTCOMES, 0)  # since the last (re)start
        self.lifetime_allocation_failures = 0
        self.lifetime_requests = 0
        self.fault = "none"
        self.fault_scope = "inference"
        self._hang_release = asyncio.Event()
        self._live: dict[int, _Live] = {}
        self._held: set[str] = set()
        self._next = 0
        self._id_prefix = secrets.token_hex(4)
        self._rng = random.Random(config.seed)
        per_token = 1.0 / (config.decode_tokens_per_s * config.speedup)
        self._per_token_s = per_token
        self._tokens_per_chunk = (
            max(1, math.ceil(config.chunk_interval_s / per_token)) if per_token > 0 else 1
        )
        self._headers = {"x-engine-name": config.name}

    # --- the allocator's figures -------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        a = self.allocator
        return {
            "name": self.config.name,
            "model": self.config.model,
            "allocator": a.kind,
            "block_size": a.block_size,
            "capacity_tokens": a.capacity_tokens,
            "free_tokens": a.free_tokens,
            "used_tokens": a.used_tokens,
            "largest_free_block_tokens": a.largest_free_block_tokens,
            "gaps": len(a.gaps()) if isinstance(a, PagedAllocator) else a.num_gaps,
            "allocations": a.num_allocations,
            "held": len(self._held),
            "running": self.running,
            "waiting": self.waiting,
            "allocation_failures": self.allocation_failures,
            "outcomes": dict(self.outcomes),
            "lifetime_allocation_failures": self.lifetime_allocation_failures,
            "lifetime_requests": self.lifetime_requests,
            "started_at": self.started_at,
            "uptime_s": max(0.0, time.time() - self.started_at),
            "restarts": self.restarts,
            "fault": self.fault,
            "fault_scope": self.fault_scope,
            "speedup": self.config.speedup,
        }

    # --- simulated time -----------------------------------------------------------------
    async def _sleep(self, live: _Live, delay: float) -> None:
        """asyncio.sleep that /admin/restart can interrupt (raises EngineRestarted)."""
        if live.restarted:
            raise EngineRestarted
        if delay <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(delay, _wake, fut)
        live.waiter = fut
        try:
            await fut
        finally:
            handle.cancel()
            live.waiter = None

    # --- admin actions ------------------------------------------------------------------
    def restart(self) -> int:
        """What a process restart does: in-flight requests fail, memory empties, uptime resets."""
        n = 0
        for live in self._live.values():
            live.restarted = True
            if live.waiter is not None and not live.waiter.done():
                live.waiter.set_exception(EngineRestarted())
            n += 1
        self._live.clear()
        self.allocator.reset()
        self._held.clear()
        self.running = 0
        self.allocation_failures = 0
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.started_at = time.time()
        self.restarts += 1
        self._release_hung()
        return n

    def _release_hung(self) -> None:
        self._hang_release.set()
        self._hang_release = asyncio.Event()

    def set_fault(self, mode: str, scope: str = "inference") -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}, got {mode!r}")
        if scope not in FAULT_SCOPES:
            raise ValueError(f"scope must be one of {FAULT_SCOPES}, got {scope!r}")
        if self.fault == "hang" and mode != "hang":
            self._release_hung()
        self.fault = mode
        self.fault_scope = scope

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
        cfg = self.config
        try:
            body, p = parse_body(await request.read(), chat, cfg.default_max_tokens)
            if cfg.strict_model and p.model != cfg.model:
                raise BadRequest(
                    f"The model `{p.model}` does not exist.",
                    "model",
                    "model_not_found",
                    404,
                    "NotFoundError",
                )
        except BadRequest as exc:
            self.outcomes["bad_request"] += 1
            return self._error(exc.status, error_body(exc.message, exc.type, exc.param, exc.code))
        self.waiting += 1
        try:
            prompt_tokens = await count_prompt_async(body)
        finally:
            self.waiting -= 1
        demand = prompt_tokens + p.max_tokens
        alloc = self.allocator
        if alloc.charge(demand) > alloc.capacity_tokens:
            self.outcomes["context_length_exceeded"] += 1
            what = "messages" if chat else "prompt"
            msg = (
                f"This model's maximum context length is {alloc.capacity_tokens} tokens. However, you "
                f"requested {demand} tokens ({prompt_tokens} in the {what}, {p.max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion."
            )
            return self._error(
                400, error_body(msg, "invalid_request_error", what, "context_length_exceeded")
            )
        self._next += 1
        request_no = self._next
        if alloc.allocate(request_no, demand) is None:
            self.allocation_failures += 1
            self.lifetime_allocation_failures += 1
            self.outcomes["allocation_failed"] += 1
            body_bytes = allocation_error_body(
                demand, alloc.free_tokens, alloc.largest_free_block_tokens, alloc.kind
            )
            return self._error(contract.ALLOCATION_ERROR_STATUS, body_bytes)
        live = _Live(request_no)
        self._live[request_no] = live
        self.running += 1
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
                    self._completion_id(p, request_no),
                    int(time.time()),
                    p,
                    self._text(request_no, 0, p.max_tokens),
                    prompt_tokens,
                ),
                content_type=JSON,
                headers=self._headers,
            )
        except EngineRestarted:
            outcome = "restarted"
            return self._error(503, self._restarted_body())
        finally:
            if not live.restarted:  # after a restart the allocator and counters are already fresh
                self._live.pop(request_no, None)
                alloc.free(request_no)
                self.running -= 1
            self.outcomes[outcome] += 1

    def _prefill_s(self, prompt_tokens: int) -> float:
        return prompt_tokens / (self.config.prefill_tokens_per_s * self.config.speedup)

    def _completion_id(self, p: Parsed, request_no: int) -> str:
        return f"{'chatcmpl' if p.chat else 'cmpl'}-{self._id_prefix}-{request_no}"

    def _text(self, request_no: int, pos: int, n: int) -> str:
        return generated_text(request_no * 7919 + self.config.seed + pos, n)

    def _restarted_body(self) -> bytes:
        return error_body(
            "the engine restarted while the request was in flight",
            RESTARTED_TYPE,
            None,
            RESTARTED_TYPE,
        )

    async def _stream(
        self, request: web.Request, live: _Live, p: Parsed, prompt_tokens: int
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
        held: list[dict[str, Any]] = []
        failed = 0
        for _ in range(count):
            self._next += 1
            hid = f"hold-{self._next}"
            offset = self.allocator.allocate(hid, tokens)
            if offset is None:
                failed += 1
                continue
            self._held.add(hid)
            held.append({"id": hid, "offset": offset, "tokens": tokens})
        return self._ok({"held": held, "failed": failed, **self._memory()})

    async def admin_release(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._json_body(request)
            ids = data.get("ids")
            if data.get("all"):
                ids = list(self._held)
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise BadRequest(
                    "give ids (a list of hold ids) or all: true", "ids", "invalid_value"
                )
        except BadRequest as exc:
            return self._error(400, error_body(exc.message, exc.type, exc.param, exc.code))
        released = 0
        for hid in ids:
            if hid in self._held:
                self._held.discard(hid)
                self.allocator.free(hid)
                released += 1
        return self._ok({"released": released, **self._memory()})

    def _memory(self) -> dict[str, int]:
        a = self.allocator
        return {
            "free_tokens": a.free_tokens,
            "largest_free_block_tokens": a.largest_free_block_tokens,
            "capacity_tokens": a.capacity_tokens,
        }


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


class EngineServer:
    """Start/stop one engine on the running loop; ``port=0`` picks a free port."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.app = build_app(config)
        self.runner: web.AppRunner | None = None
        self.port = config.port

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> int:
        # Load the tokenizer now (about a second), not on the first request.
        await asyncio.to_thread(encoding)
        self.runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        addrs = self.runner.addresses
        self.port = int(addrs[0][1]) if addrs else self.config.port
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            self.engine.set_fault("none")  # let hung requests go
            await self.runner.cleanup()
            self.runner = None


async def serve(config: EngineConfig, ready_line: bool = True) -> None:
    """Serve until SIGINT/SIGTERM; prints one 'listening on URL' line (tests read the port from it)."""
    server = EngineServer(config)
    try:
        await server.start()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        # One line and a non-zero exit, not a traceback: the usual cause is a second engine.
        raise SystemExit(
            f"kvroute engine: port {config.port} is in use on {config.host}; pick another with --port"
        ) from None
    if ready_line:
        print(f"kvroute engine (name: {config.name}) listening on {server.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run(config: EngineConfig) -> None:
    """Run one engine in this process until interrupted (uvloop when available and enabled)."""
    if config.uvloop:
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency of uvicorn[standard]
            pass
        else:
            uvloop.run(serve(config))
            return
    asyncio.run(serve(config))


# --- CLI -------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, for ``kvroute engine`` and ``python -m loadtest.engine.server``."""
    d = EngineConfig()
    parser.add_argument("--host", default=d.host, help=f"listen address (default {d.host})")
    parser.add_argument(
        "--port", type=int, default=d.port, help=f"listen port, 0 = any free (default {d.port})"
    )
    parser.add_argument(
        "--name", default=d.name, help="engine name, sent as the x-engine-name header"
    )
    parser.add_argument("--model", default=d.model, help=f"model id served (default {d.model})")
    parser.add_argument(
        "--allocator",
        choices=("contiguous", "paged"),
        default=d.allocator,
        help="KV-cache allocator",
    )
    parser.add_argument(
        "--capacity-tokens",
        type=int,
        default=d.capacity_tokens,
        help=f"KV cache size (default {d.capacity_tokens})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="paged allocator block size (default 16)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d.prefill_tokens_per_s,
        help="prompt processing rate",
    )
    parser.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=d.decode_tokens_per_s,
        help="output rate per request",
    )
    parser.add_argument(
        "--speedup", type=float, default=d.speedup, help="divide all simulated times by this"
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="max_tokens when a request omits it",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for the generated text")
    parser.add_argument(
        "--chunk-interval-s",
        type=float,
        default=d.chunk_interval_s,
        help="min seconds between stream chunks",
    )
    parser.add_argument(
        "--strict-model", action="store_true", help="404 for a model other than --model"
    )
    parser.add_argument(
        "--behaviour",
        choices=("kvroute", "vllm", "sglang", "tgi"),
        default="kvroute",
        help="kvroute: allocate at admission, 503 on failure (default); vllm/sglang/tgi: that "
        "server's paged, lazily allocating, queueing behaviour and its own metric names",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="running requests per engine (vllm/sglang/tgi)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="per-request token limit, answered with the server's own 400 (default: the KV size)",
    )
    parser.add_argument(
        "--data-parallel", type=int, default=1, help="engines behind one port (vllm/sglang)"
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="vllm: turn off the automatic prefix cache (cached prompt blocks skip prefill)",
    )
    parser.add_argument(
        "--serial-prefill",
        action="store_true",
        help="vllm/sglang/tgi: prefill prompts one after another (one GPU's compute) "
        "instead of all at full speed at once",
    )
    parser.add_argument(
        "--tokenizer-ratio",
        type=float,
        default=1.0,
        help="vllm/sglang/tgi: count prompts as this many tokens per token of the gateway's "
        "default (cl100k) count, as a server with another tokenizer does (default 1.0)",
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="vllm: publish KV-cache events as vLLM does, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/kv-events.md)',
    )
    disaggregation.add_arguments(parser)
    parser.add_argument(
        "--die-after-tokens",
        type=int,
        default=None,
        help="vllm/sglang/tgi: reset every stream's connection after this many tokens "
        "(mid-stream failures; POST /admin/fault sets one at run time)",
    )
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's default event loop")
    parser.add_argument("--log-level", default="warning", help="logging level (default warning)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        name=args.name,
        host=args.host,
        port=args.port,
        model=args.model,
        allocator=args.allocator,
        capacity_tokens=args.capacity_tokens,
        block_size=args.block_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        speedup=args.speedup,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
        chunk_interval_s=args.chunk_interval_s,
        strict_model=args.strict_model,
        uvloop=not args.no_uvloop,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Entry for a CLI that built its parser with :func:`add_arguments`."""
    logging.basicConfig(
        level=str(args.log_level).upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "behaviour", "kvroute") != "kvroute":
        from loadtest.engine.behaviours import run as run_behaviour

        bconf = behaviour_config_from_args(args)
        log.info("starting engine %s", asdict(bconf))
        run_behaviour(bconf, args.host, args.port)
        return 0
    config = config_from_args(args)
    log.info("starting engine %s", asdict(config))
    run(config)
    return 0


def behaviour_config_from_args(args: argparse.Namespace) -> BehaviourConfig:
    from loadtest.engine.behaviours import BehaviourConfig

    return BehaviourConfig(
        behaviour=args.behaviour,
        name=args.name,
        model=args.model,
        capacity_tokens=args.capacity_tokens,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        data_parallel=args.data_parallel,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        speedup=args.speedup,
        seed=args.seed,
        prefix_caching=not getattr(args, "no_prefix_caching", False),
        serial_prefill=getattr(args, "serial_prefill", False),
        tokenizer_ratio=getattr(args, "tokenizer_ratio", 1.0),
        kv_events_config=getattr(args, "kv_events_config", None),
        pd=disaggregation.role_config_from_args(args),
        die_after_tokens=getattr(args, "die_after_tokens", None),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvroute engine", description="Simulated inference engine with a fragmenting KV cache"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config_from_args(args)
        if args.behaviour != "kvroute":
            behaviour_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
