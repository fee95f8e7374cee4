"""Gateway overhead: direct access vs kvroute vs vllm-router, on the same backends, in one run.

Starts trivial backends (``loadtest.engine.trivial``: every answer pre-built, so what is
measured on top of them is the router's cost), then, one after another, drives the same
tiny OpenAI chat request at each target and concurrency with the same load generator:

- ``direct``: the first backend itself, no router;
- ``kvroute``: ``kvroute serve`` as shipped (FastAPI on uvicorn, httptools, uvloop, aiohttp
  upstream client), embedded store; ``kvroute-redis``: the same on a local redis-server;
- ``vllm-router``: the Rust router from PyPI (``--policy round_robin``), where installed;
- with ``--variants``: the same gateway on other server stacks (plain Starlette routes,
  h11, the asyncio loop, two uvicorn workers on Redis) and two do-nothing pass-through
  proxies (aiohttp.web, Starlette) that show each stack's floor. These are measurements
  for choosing settings; ``proxy/`` itself is not changed by this script.

For each it prints requests/s and the ratio to direct, p50/p99 latency and what the router
adds to them, the router's CPU time per request (the least noisy figure on a shared box),
and for ``stream: true`` the SSE relay rate in events/s. The load generator is wrk (Debian
package ``wrk``) with a Lua script when installed, else an in-process aiohttp generator;
``--calibrate`` measures both against direct so the choice is evidence, not habit.

    python -m loadtest.bench.overhead --duration 3 --concurrency 1,16,64 --json out/overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from loadtest.local_fleet import EngineSpec, Proc, free_port, gateway_config, redis_proc, wait_http

CHAT_PATH = "/v1/chat/completions"
MODEL = "trivial"
VLLM_ROUTER_CANDIDATES = ("/tmp/vllm-router-venv/bin/vllm-router",)
VARIANTS = (
    "redis-bg-release",
    "starlette",
    "h11",
    "asyncio-loop",
    "workers2-redis",
    "passthrough-starlette",
    "passthrough-aiohttp",
)


def request_body(stream: bool) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "stream": stream,
    }
    return json.dumps(body, separators=(",", ":")).encode()


# ------------------------------------------------------------------ process accounting


def _children(pid: int) -> list[int]:
    """All descendants of `pid` (uvicorn workers, launcher children), from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """user + system CPU seconds of these processes and all their descendants (threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    seen: set[int] = set()
    for root in pids:
        for p in _children(root):
            if p in seen:
                continue
            seen.add(p)
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


# ------------------------------------------------------------------ load generators


@dataclass
class Load:
    requests: int
    errors: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    events: int = 0  # SSE events counted by the generator itself (python generator only)

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


WRK_LUA = """
wrk.method = "POST"
wrk.body = [[{body}]]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVBENCH %d %d %d %d %d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def find_wrk() -> str | None:
    return shutil.which("wrk")


def run_wrk(
    wrk: str,
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    workdir: Path,
    threads: int = 1,
) -> Load:
    script = workdir / f"post-{abs(hash(body))}.lua"
    if not script.exists():
        script.write_text(WRK_LUA.replace("{body}", body.decode()))
    argv = [
        wrk,
        f"-t{min(threads, concurrency)}",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("KVBENCH "):
            n, dur_us, p50, p99, errs = (int(x) for x in line.split()[1:])
            return Load(n, errs, dur_us / 1e6, p50 / 1000, p99 / 1000)
    raise RuntimeError(
        f"wrk printed no summary (rc {out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}"
    )


async def run_python_load(url: str, body: bytes, concurrency: int, duration_s: float) -> Load:
    """Closed loop: `concurrency` keep-alive connections, each sending the next request on answer."""
    lat: list[float] = []
    errors = 0
    events = 0
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        start = time.perf_counter()
        deadline = start + duration_s

        async def worker() -> None:
            nonlocal errors, events
            while True:
                t0 = time.perf_counter()
                if t0 >= deadline:
                    return
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        data = await resp.read()
                        if resp.status != 200:
                            errors += 1
                            continue
                        events += data.count(b"data:")
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        dur = time.perf_counter() - start
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    return Load(len(lat), errors, dur, pct(0.5), pct(0.99), events)


# ------------------------------------------------------------------ targets


@dataclass
class Target:
    name: str
    url: str
    procs: list[Proc] = field(default_factory=list)
    note: str = ""

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs if p.popen is not None]


def wait_post_ok(url: str, timeout_s: float = 30.0, proc: Proc | None = None) -> None:
    """Ready means a real request gets a 200 through it (routers answer 503 until they see a backend)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.popen is not None and proc.popen.poll() is not None:
            raise RuntimeError(
                f"{proc.name} exited with {proc.popen.returncode} (log: {proc.log_path})"
            )
        try:
            r = httpx.post(
                url + CHAT_PATH,
                content=request_body(False),
                headers={"content-type": "application/json"},
                timeout=2.0,
            )
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = exc.__class__.__name__
        time.sleep(0.1)
    raise TimeoutError(f"{url} never answered 200 within {timeout_s}s ({last})")


def count_sse_events(url: str) -> int:
    """Events in one streamed answer through `url`: proves the stream was relayed whole."""
    n = 0
    with httpx.stream(
        "POST",
        url + CHAT_PATH,
        content=request_body(True),
        headers={"content-type": "application/json"},
        timeout=10.0,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                n += 1
    return n


def find_vllm_router(explicit: str | None) -> str | None:
    if explicit:
        return explicit if (shutil.which(explicit) or Path(explicit).exists()) else None
    found = shutil.which("vllm-router")
    if found:
        return found
    return next((c for c in VLLM_ROUTER_CANDIDATES if Path(c).exists()), None)


@dataclass
class Bench:
    args: argparse.Namespace
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvroute-bench-")))
    backends: list[Proc] = field(default_factory=list)
    redis: Proc | None = None
    started: list[Proc] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def start(self, p: Proc, env: dict[str, str] | None = None) -> Proc:
        p.start(env=env, log_dir=self.workdir)
        self.started.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.started):
            with contextlib.suppress(Exception):
                p.stop(timeout_s=5)
        self.started.clear()

    def start_backends(self) -> None:
        for i in range(self.args.backends):
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "loadtest.engine.trivial",
                "--port",
                str(port),
                "--stream-chunks",
                str(self.args.stream_chunks),
                "--model",
                MODEL,
            ]
            self.backends.append(self.start(Proc(f"backend-{i}", argv, f"http://127.0.0.1:{port}")))
        for p in self.backends:
            wait_http(p.url + "/health", proc=p.popen)

    def ensure_redis(self) -> str:
        if self.redis is None:
            import redis as redis_lib

            self.redis = self.start(redis_proc(self.workdir))
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis_lib.Redis.from_url(self.redis.url).ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        return self.redis.url

    def gateway_config_path(self, name: str, redis: bool) -> Path:
        specs = [(EngineSpec(f"b{i}"), p.url) for i, p in enumerate(self.backends)]
        overrides: dict[str, Any] = {
            "collector": {"scrape_interval_s": 1.0, "stale_after_s": 5.0},
            "routing": {"policy": self.args.policy},
        }
        if redis:
            overrides["store"] = {"redis_url": self.ensure_redis()}
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(gateway_config(specs, **overrides), sort_keys=False))
        return path

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}

    # -- the targets
    def direct(self) -> Target:
        return Target("direct", self.backends[0].url, [self.backends[0]], "backend-0 itself")

    def kvroute(self, name: str, redis: bool) -> Target:
        port = free_port()
        cfg = self.gateway_config_path(name, redis)
        argv = [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--config",
            str(cfg),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        p = self.start(Proc(name, argv, f"http://127.0.0.1:{port}"), env=self.env())
        wait_post_ok(p.url, proc=p)
        return Target(
            name,
            p.url,
            [p],
            "kvroute serve (FastAPI, uvicorn httptools+uvloop)"
            + (", Redis store" if redis else ""),
        )

    def variant(self, kind: str) -> Target:
        port = free_port()
        redis = kind in ("workers2-redis", "redis-bg-release")
        cfg = self.gateway_config_path(kind, redis)
        backends = ",".join(p.url for p in self.backends)
        argv = [
            sys.executable,
            "-m",
            "loadtest.bench.overhead",
            "serve-variant",
            kind,
            "--config",
            str(cfg),
            "--port",
            str(port),
            "--backends",
            backends,
        ]
        p = self.start(Proc(kind, argv, f"http://127.0.0.1:{port}"), env=self.env())
        wait_post_ok(p.url, proc=p)
        return Target(kind, p.url, [p], VARIANT_NOTES[kind])

    def vllm_router(self) -> Target | None:
        exe = find_vllm_router(self.args.vllm_router)
        if exe is None:
            self.skipped["vllm-router"] = (
                "not installed: no `vllm-router` on PATH nor in /tmp/vllm-router-venv "
                "(python -m venv /tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router)"
            )
            return None
        port = free_port()
        argv = [
            exe,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-level",
            "warning",
            "--worker-urls",
            *(p.url for p in self.backends),
        ]
        p = self.start(Proc("vllm-router", argv, f"http://127.0.0.1:{port}"))
        try:
            wait_post_ok(p.url, timeout_s=60, proc=p)
        except (RuntimeError, TimeoutError) as exc:
            self.skipped["vllm-router"] = f"installed at {exe} but did not serve: {exc}"
            p.stop()
            return None
        return Target("vllm-router", p.url, [p], f"{exe} --policy round_robin")


VARIANT_NOTES = {
    "starlette": "same gateway, plain Starlette routes instead of FastAPI's",
    "h11": "same gateway, uvicorn --http h11 instead of httptools",
    "asyncio-loop": "same gateway, asyncio's default loop instead of uvloop",
    "workers2-redis": "same gateway, 2 uvicorn workers sharing the Redis store",
    "redis-bg-release": "same gateway on Redis, reservation release run in the background, not awaited before answering",
    "passthrough-starlette": "do-nothing relay: Starlette on uvicorn + aiohttp client (no routing)",
    "passthrough-aiohttp": "do-nothing relay: aiohttp.web server + aiohttp client (no routing)",
}


# ------------------------------------------------------------------ variant servers (subprocess side)


def _gateway_starlette(cfg_path: str) -> Any:
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

    def release(self: ReservationLedger, backend: str, rid: str) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        task = loop.create_task(original(self, backend, rid))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return done

    ReservationLedger.release = release  # type: ignore[assignment,method-assign]


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
        uvicorn.run(_gateway_starlette(a.config), loop="uvloop", http="httptools", **common)
        return 0
    if a.kind == "redis-bg-release":
        _release_in_background()
    if a.kind == "workers2-redis":
        os.environ["KVBENCH_CONFIG"] = a.config
        uvicorn.run(
            "loadtest.bench.overhead:variant_app_factory",
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


# ------------------------------------------------------------------ in-process ASGI layer cost


def _asgi_scope(body: bytes) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": CHAT_PATH,
        "raw_path": CHAT_PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _asgi_cpu_per_request(app: Any, n: int, concurrency: int = 16) -> float:
    """CPU microseconds per request of `app` called directly (no HTTP server), backend over the network."""
    body = request_body(False)

    async def one() -> None:
        statuses: list[int] = []
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(_asgi_scope(body), receive, send)
        if statuses != [200]:
            raise RuntimeError(f"in-process request answered {statuses}")

    sem = asyncio.Semaphore(concurrency)

    async def guarded() -> None:
        async with sem:
            await one()

    async with app.router.lifespan_context(app):
        await asyncio.gather(
            *(guarded() for _ in range(min(200, n)))
        )  # warm: tokenizer, pools, snapshot
        t0 = time.process_time()
        await asyncio.gather(*(guarded() for _ in range(n)))
        return (time.process_time() - t0) / n * 1e6


def asgi_layer_cost(cfg_path: Path, n: int, rounds: int) -> dict[str, Any]:
    """The same Gateway behind FastAPI's route vs a plain Starlette route, called in-process, alternating."""
    from proxy.api.app import create_app
    from proxy.config import load_config

    runs: dict[str, list[float]] = {"fastapi": [], "starlette": []}
    for _ in range(rounds):
        for kind in runs:
            app = (
                create_app(load_config(cfg_path))
                if kind == "fastapi"
                else _gateway_starlette(str(cfg_path))
            )
            runs[kind].append(asyncio.run(_asgi_cpu_per_request(app, n)))
    fa, st = statistics.median(runs["fastapi"]), statistics.median(runs["starlette"])
    return {
        "requests_per_round": n,
        "rounds": rounds,
        "fastapi_cpu_us_per_req": round(fa, 1),
        "starlette_cpu_us_per_req": round(st, 1),
        "fastapi_extra_us_per_req": round(fa - st, 1),
        "fastapi_over_starlette": round(fa / st, 3) if st > 0 else None,
        "all_rounds": {k: [round(x, 1) for x in v] for k, v in runs.items()},
    }


# ------------------------------------------------------------------ measuring


@dataclass
class Point:
    target: str
    mode: str  # "json" or "sse"
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    router_cpu_us_per_req: float | None
    backend_cpu_us_per_req: float
    events_per_response: int | None = None
    events_per_s: float | None = None
    rps_ratio_vs_direct: float | None = None
    p50_added_ms: float | None = None
    p99_added_ms: float | None = None
    rounds: int = 1


def measure(bench: Bench, target: Target, mode: str, conc: int, gen: str, wrk: str | None) -> Point:
    body = request_body(mode == "sse")
    url = target.url + CHAT_PATH
    backend_pids = [p.popen.pid for p in bench.backends if p.popen is not None]
    router_pids = [] if target.name == "direct" else target.pids
    b0, r0 = cpu_seconds(backend_pids), cpu_seconds(router_pids)
    if gen == "wrk" and wrk is not None:
        load = run_wrk(
            wrk, url, body, conc, bench.args.duration, bench.workdir, bench.args.wrk_threads
        )
    else:
        load = asyncio.run(run_python_load(url, body, conc, bench.args.duration))
    b1, r1 = cpu_seconds(backend_pids), cpu_seconds(router_pids)
    n = max(1, load.requests)
    return Point(
        target=target.name,
        mode=mode,
        concurrency=conc,
        rps=load.rps,
        p50_ms=load.p50_ms,
        p99_ms=load.p99_ms,
        errors=load.errors,
        requests=load.requests,
        router_cpu_us_per_req=None if target.name == "direct" else (r1 - r0) / n * 1e6,
        backend_cpu_us_per_req=(b1 - b0) / n * 1e6,
    )


def merge_rounds(points: list[Point]) -> Point:
    """Median over rounds of the same (target, mode, concurrency)."""
    first = points[0]
    if len(points) == 1:
        return first

    def med(vals: list[float | None]) -> float | None:
        xs = [v for v in vals if v is not None]
        return statistics.median(xs) if xs else None

    return Point(
        target=first.target,
        mode=first.mode,
        concurrency=first.concurrency,
        rps=statistics.median(p.rps for p in points),
        p50_ms=statistics.median(p.p50_ms for p in points),
        p99_ms=statistics.median(p.p99_ms for p in points),
        errors=sum(p.errors for p in points),
        requests=sum(p.requests for p in points),
        router_cpu_us_per_req=med([p.router_cpu_us_per_req for p in points]),
        backend_cpu_us_per_req=statistics.median(p.backend_cpu_us_per_req for p in points),
        rounds=len(points),
    )


def add_ratios(points: list[Point], events: dict[str, int]) -> None:
    direct = {(p.mode, p.concurrency): p for p in points if p.target == "direct"}
    for p in points:
        if p.mode == "sse":
            p.events_per_response = events.get(p.target)
            if p.events_per_response is not None:
                p.events_per_s = p.rps * p.events_per_response
        d = direct.get((p.mode, p.concurrency))
        if d is not None and d.rps > 0:
            p.rps_ratio_vs_direct = p.rps / d.rps
            p.p50_added_ms = p.p50_ms - d.p50_ms
            p.p99_added_ms = p.p99_ms - d.p99_ms


def calibrate(bench: Bench, wrk: str | None) -> dict[str, Any]:
    """Both generators against direct at the highest concurrency: the faster one is not the bottleneck."""
    conc = max(bench.args.concurrency)
    target = bench.direct()
    out: dict[str, Any] = {"concurrency": conc}
    for gen in (["wrk"] if wrk else []) + ["python"]:
        p = measure(bench, target, "json", conc, gen, wrk)
        out[gen] = {
            "rps": round(p.rps, 1),
            "p50_ms": round(p.p50_ms, 3),
            "backend_cpu_us_per_req": round(p.backend_cpu_us_per_req, 1),
        }
    return out


def loadavg() -> list[float]:
    with contextlib.suppress(OSError):
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    return []


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(points: list[Point], skipped: dict[str, str], notes: dict[str, str]) -> None:
    for mode in ("json", "sse"):
        rows = [p for p in points if p.mode == mode]
        if not rows:
            continue
        title = (
            "non-streaming chat completions"
            if mode == "json"
            else "streaming (SSE) chat completions"
        )
        print(f"\n== {title} ==")
        head = f"{'target':<22} {'conc':>4} {'req/s':>8} {'x direct':>8} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>7} {'+p99 ms':>7} {'router CPU us/req':>17} {'err':>4}"
        if mode == "sse":
            head += f" {'events/s':>9}"
        print(head)
        for p in sorted(rows, key=lambda r: (r.concurrency, r.target != "direct", r.target)):
            line = (
                f"{p.target:<22} {p.concurrency:>4} {p.rps:>8.0f} {_fmt(p.rps_ratio_vs_direct, '.2f'):>8} {p.p50_ms:>7.2f} {p.p99_ms:>7.2f} "
                f"{_fmt(p.p50_added_ms, '+.2f'):>7} {_fmt(p.p99_added_ms, '+.2f'):>7} {_fmt(p.router_cpu_us_per_req, '.0f'):>17} {p.errors:>4}"
            )
            if mode == "sse":
                line += f" {_fmt(p.events_per_s, ',.0f'):>9}"
            print(line)
    print()
    for name, note in notes.items():
        print(f"  {name}: {note}")
    for name, why in skipped.items():
        print(f"  SKIPPED {name}: {why}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.overhead",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument(
        "--duration", type=float, default=3.0, help="seconds per measurement point (default 3)"
    )
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 16, 64],
        help="comma list (default 1,16,64)",
    )
    p.add_argument(
        "--modes",
        default="json,sse",
        help="json (non-streaming), sse (streaming), or both (default)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every point this often, interleaved; medians are reported",
    )
    p.add_argument(
        "--backends",
        type=int,
        default=1,
        help="trivial backends behind the routers (direct uses the first)",
    )
    p.add_argument(
        "--stream-chunks", type=int, default=64, help="SSE events per streamed answer (default 64)"
    )
    p.add_argument(
        "--policy",
        default="kvroute",
        help="kvroute routing policy for the gateway (default kvroute)",
    )
    p.add_argument("--no-redis", action="store_true", help="skip the kvroute-redis target")
    p.add_argument(
        "--no-vllm-router", action="store_true", help="skip vllm-router even if installed"
    )
    p.add_argument(
        "--vllm-router",
        default=None,
        help="path of the vllm-router executable (default: PATH, then /tmp/vllm-router-venv)",
    )
    p.add_argument(
        "--variants",
        default="",
        help=f"comma list of server variants to add, or 'all': {', '.join(VARIANTS)}",
    )
    p.add_argument(
        "--variant-concurrency",
        type=int,
        default=None,
        help="variants run at this concurrency only (default: the highest)",
    )
    p.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="auto: wrk when installed",
    )
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure wrk and the python generator against direct first",
    )
    p.add_argument(
        "--asgi-layers",
        type=int,
        default=0,
        metavar="N",
        help="also time N in-process requests through FastAPI vs Starlette routes",
    )
    p.add_argument(
        "--json", dest="json_out", default=None, help="write all results as JSON to this file"
    )
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    wrk = find_wrk()
    gen = "wrk" if args.loadgen == "wrk" or (args.loadgen == "auto" and wrk) else "python"
    if gen == "wrk" and wrk is None:
        raise SystemExit("--loadgen wrk: wrk is not installed (Debian: apt-get install -y wrk)")
    modes = [m for m in args.modes.split(",") if m]
    variants = (
        list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    )
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    bench = Bench(args)
    started = time.time()
    load_before = loadavg()
    try:
        bench.start_backends()
        targets = [bench.direct(), bench.kvroute("kvroute", redis=False)]
        if not args.no_redis:
            if shutil.which("redis-server"):
                targets.append(bench.kvroute("kvroute-redis", redis=True))
            else:
                bench.skipped["kvroute-redis"] = "redis-server is not installed"
        if not args.no_vllm_router:
            vr = bench.vllm_router()
            if vr is not None:
                targets.append(vr)
        extra = [bench.variant(v) for v in variants]
        cal = calibrate(bench, wrk) if args.calibrate else None
        layers = (
            asgi_layer_cost(bench.gateway_config_path("asgi-layers", False), args.asgi_layers, 3)
            if args.asgi_layers > 0
            else None
        )
        events = (
            {t.name: count_sse_events(t.url) for t in targets + extra} if "sse" in modes else {}
        )
        raw: dict[tuple[str, str, int], list[Point]] = {}
        vconc = args.variant_concurrency or max(args.concurrency)
        for _ in range(args.rounds):
            for mode in modes:
                for conc in args.concurrency:
                    todo = targets + extra if conc == vconc else targets
                    for t in todo:
                        raw.setdefault((t.name, mode, conc), []).append(
                            measure(bench, t, mode, conc, gen, wrk)
                        )
        points = [merge_rounds(v) for v in raw.values()]
        add_ratios(points, events)
        notes = {t.name: t.note for t in targets + extra}
    finally:
        bench.stop_all()
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": loadavg(),
            "python": sys.version.split()[0],
        },
        "loadgen": gen,
        "duration_s_per_point": args.duration,
        "backends": args.backends,
        "stream_chunks": args.stream_chunks,
        "calibration": cal,
        "asgi_layers": layers,
        "points": [asdict(p) for p in points],
        "skipped": bench.skipped,
        "notes": notes,
        "elapsed_s": round(time.time() - started, 1),
    }
    print(
        f"load generator: {gen}; {os.cpu_count()} CPUs; load average before {load_before}, after {result['machine']['loadavg_after']}"
    )
    if cal:
        print(
            f"calibration against direct at c={cal['concurrency']}: "
            + "; ".join(f"{k}: {v}" for k, v in cal.items() if k != "concurrency")
        )
    if layers:
        print(
            f"in-process, same gateway: FastAPI route {layers['fastapi_cpu_us_per_req']} us CPU/request, "
            f"Starlette route {layers['starlette_cpu_us_per_req']} us ({layers['fastapi_over_starlette']}x)"
        )
    print_table(points, bench.skipped, notes)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve-variant":
        return serve_variant(argv[1:])
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
