"""The overhead benchmark's variants: the same gateway on other server stacks, and two
do-nothing pass-through proxies that show each stack's floor (run as subprocesses).

These are measurements for choosing settings; ``proxy/`` itself is not changed by them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

import aiohttp

VARIANTS = (
    "redis-bg-release",
    "redis-stock-client",
    "redis-no-batch",
    "starlette",
    "h11",
    "asyncio-loop",
    "workers2-redis",
    "passthrough-starlette",
    "passthrough-aiohttp",
    "granian",
    "aiohttp-server",
)

VARIANT_NOTES = {
    "starlette": "same gateway, plain Starlette routes instead of FastAPI's",
    "h11": "same gateway, uvicorn --http h11 instead of httptools",
    "asyncio-loop": "same gateway, asyncio's default loop instead of uvloop",
    "workers2-redis": "same gateway, 2 uvicorn workers sharing the Redis store",
    "redis-bg-release": "same gateway on Redis, reservation release run in the background, not awaited before answering",
    "redis-stock-client": "same gateway on Redis, reserve and release through redis-py's execute_command (no lean lane), one release task per request (no batching)",
    "redis-no-batch": "same gateway on Redis, lean lane, but one release task and round trip per request (no batching)",
    "passthrough-starlette": "do-nothing relay: Starlette on uvicorn + aiohttp client (no routing)",
    "passthrough-aiohttp": "do-nothing relay: aiohttp.web server + aiohttp client (no routing)",
    "granian": "same gateway app on granian (Rust HTTP server, ASGI, uvloop) instead of uvicorn",
    "aiohttp-server": "same gateway app on aiohttp.web's server through a minimal ASGI adapter",
}


# ------------------------------------------------------------------ variant servers (subprocess side)


def gateway_starlette(cfg_path: str) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from proxy.api.app import create_app
    from proxy.config import load_config

    fastapi_app = create_app(load_config(cfg_path))

    async def chat(request: Request) -> Response:
        return await request.app.state.rt.gateway.handle(request, "chat")  # type: ignore[no-any-return]

    async def completions(request: Request) -> Response:
        return await request.app.state.rt.gateway.handle(request, "completions")  # type: ignore[no-any-return]

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    # The FastAPI app's lifespan stores the runtime on whichever app it is given.
    return Starlette(routes=routes, lifespan=fastapi_app.router.lifespan_context)


def _hop(headers: Any) -> dict[str, str]:
    from proxy.upstream.client import forward_headers

    return forward_headers(headers, False)


def _passthrough_starlette(backends: list[str]) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Any] = {"i": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> Any:
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0), auto_decompress=False
        )
        yield
        await state["session"].close()

    async def relay(request: Request) -> Response:
        body = await request.body()
        state["i"] += 1
        url = backends[state["i"] % len(backends)] + request.url.path
        resp = await state["session"].post(url, data=body, headers=_hop(request.headers))
        ctype = resp.headers.get("content-type", "application/json")
        if ctype.startswith("text/event-stream"):

            async def chunks() -> Any:
                try:
                    async for c in resp.content.iter_any():
                        yield c
                finally:
                    resp.release()

            return StreamingResponse(chunks(), status_code=resp.status, media_type=ctype)
        data = await resp.read()
        resp.release()
        return Response(data, status_code=resp.status, media_type=ctype)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", relay, methods=["POST"]),
            Route("/v1/completions", relay, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def _passthrough_aiohttp(backends: list[str], port: int) -> None:
    import uvloop
    from aiohttp import web

    state: dict[str, Any] = {"i": 0}

    async def on_startup(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0), auto_decompress=False
        )

    async def on_cleanup(app: web.Application) -> None:
        await state["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state["i"] += 1
        url = backends[state["i"] % len(backends)] + request.path
        async with state["session"].post(url, data=body, headers=_hop(request.headers)) as resp:
            ctype = resp.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                return web.Response(
                    body=await resp.read(), status=resp.status, headers={"Content-Type": ctype}
                )
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": ctype})
            await out.prepare(request)
            async for c in resp.content.iter_any():
                await out.write(c)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)


def _release_in_background() -> None:
    """Experiment: the store's release call runs as a task; callers' awaits return at once."""
    from proxy.gateway.ledger import ReservationLedger

    original = ReservationLedger.release
    tasks: set[asyncio.Task[None]] = set()

    def release(self: ReservationLedger, backend: str, reservation_id: str) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        task = loop.create_task(original(self, backend, reservation_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return done

    ReservationLedger.release = release  # type: ignore[assignment,method-assign]


def _release_per_request() -> None:
    """A/B of the batched releases: a task and a store call per request, as before."""
    from proxy.gateway.ledger import ReservationLedger

    original = ReservationLedger.release_at_once

    def release_at_once(self: ReservationLedger, backend: str, reservation_id: str) -> bool:
        if not self._calls_never_suspend:
            return False
        return original(self, backend, reservation_id)

    ReservationLedger.release_at_once = release_at_once  # type: ignore[method-assign]


def _stock_redis_client() -> None:
    """A/B of the lean lane (proxy.state.redis_lane): every command through redis-py's client."""
    from proxy.state.redis_store import RedisStore

    _release_per_request()
    original = RedisStore.__init__

    def init(self: RedisStore, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._lane = None

    RedisStore.__init__ = init  # type: ignore[method-assign]


def variant_app_factory() -> Any:
    """uvicorn factory for multi-worker variants (each worker builds its own app)."""
    from proxy.api.app import create_app
    from proxy.config import load_config

    return create_app(load_config(os.environ["KVBENCH_CONFIG"]))


def serve_variant(argv: Sequence[str]) -> int:
    import logging

    import uvicorn

    p = argparse.ArgumentParser(prog="bench_overhead serve-variant")
    p.add_argument("kind", choices=VARIANTS)
    p.add_argument("--config", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument(
        "--backends", required=True, help="comma-separated backend URLs (pass-through variants)"
    )
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    common: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": a.port,
        "access_log": False,
        "log_level": "warning",
        "timeout_keep_alive": 30,
        "backlog": 4096,
    }
    backends = a.backends.split(",")
    if a.kind == "passthrough-aiohttp":
        _passthrough_aiohttp(backends, a.port)
        return 0
    if a.kind == "passthrough-starlette":
        uvicorn.run(_passthrough_starlette(backends), loop="uvloop", http="httptools", **common)
        return 0
    if a.kind == "starlette":
        uvicorn.run(gateway_starlette(a.config), loop="uvloop", http="httptools", **common)
        return 0
    if a.kind == "granian":
        from granian import Granian

        os.environ["KVBENCH_CONFIG"] = a.config
        Granian(
            "loadtest.bench.overhead_variants:variant_app_factory",
            factory=True,
            address="127.0.0.1",
            port=a.port,
            interface="asgi",  # type: ignore[arg-type]
            loop="uvloop",  # type: ignore[arg-type]
            http="1",  # type: ignore[arg-type]
            workers=1,
            backlog=4096,
            log_level="warning",  # type: ignore[arg-type]
        ).serve()
        return 0
    if a.kind == "aiohttp-server":
        from loadtest.bench.asgi_on_aiohttp import serve_asgi

        os.environ["KVBENCH_CONFIG"] = a.config
        serve_asgi(variant_app_factory(), a.port)
        return 0
    if a.kind == "redis-bg-release":
        _release_in_background()
    if a.kind == "redis-stock-client":
        _stock_redis_client()
    if a.kind == "redis-no-batch":
        _release_per_request()
    if a.kind == "workers2-redis":
        os.environ["KVBENCH_CONFIG"] = a.config
        uvicorn.run(
            "loadtest.bench.overhead_variants:variant_app_factory",
            factory=True,
            workers=2,
            loop="uvloop",
            http="httptools",
            **common,
        )
        return 0
    from proxy.api.app import create_app
    from proxy.config import load_config

    app = create_app(load_config(a.config))
    if a.kind == "h11":
        uvicorn.run(app, loop="uvloop", http="h11", **common)
    elif a.kind == "asyncio-loop":
        uvicorn.run(app, loop="asyncio", http="httptools", **common)
    else:  # redis-bg-release: as shipped, with the patch above
        uvicorn.run(app, loop="uvloop", http="httptools", **common)
    return 0
