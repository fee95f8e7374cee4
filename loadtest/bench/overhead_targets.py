"""The overhead benchmark's targets: trivial backends, kvroute, the bare proxy and
vllm-router, started as processes and torn down together."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.bench.bare_proxy import NOTE as BARE_PROXY_NOTE
from loadtest.bench.overhead_load import CHAT_PATH, MODEL, request_body
from loadtest.local_fleet import EngineSpec, Proc, free_port, gateway_config, redis_proc, wait_http

VLLM_ROUTER_CANDIDATES = ("/tmp/vllm-router-venv/bin/vllm-router",)


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
        shutil.rmtree(self.workdir, ignore_errors=True)

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

    def gateway_config_path(self, name: str, redis: bool, client: str | None = None) -> Path:
        specs = [(EngineSpec(f"b{i}"), p.url) for i, p in enumerate(self.backends)]
        overrides: dict[str, Any] = {
            "collector": {"scrape_interval_s": 1.0, "stale_after_s": 5.0},
            "routing": {"policy": self.args.policy},
        }
        if client is not None:
            overrides["upstream"] = {"client": client}
        on_bound = getattr(self.args, "route_on_bound", None)  # else the config's default
        if on_bound is not None:
            overrides["sizing"] = {"route_on_bound": bool(on_bound)}
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

    def kvroute(
        self,
        name: str,
        redis: bool,
        workers: int = 1,
        client: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Target:
        port = free_port()
        cfg = self.gateway_config_path(name, redis, client)
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
            "--workers",
            str(workers),
        ]
        p = self.start(Proc(name, argv, f"http://127.0.0.1:{port}"), env=self.env() | (env or {}))
        wait_post_ok(p.url, proc=p)
        return Target(
            name,
            p.url,
            [p],
            "kvroute serve (uvicorn httptools+uvloop, inference requests on the lean path)"
            + (", Redis store" if redis else "")
            + (f", --workers {workers}" if workers > 1 else "")
            + (f", upstream.client {client}" if client else "")
            + (", head and body in two writes" if env else ""),
        )

    def bare_proxy(self) -> Target:
        """The do-nothing relay (``loadtest.bench.bare_proxy``) over the same backends."""
        port = free_port()
        backends = ",".join(p.url for p in self.backends)
        argv = [sys.executable, "-m", "loadtest.bench.bare_proxy", "--port", str(port)]
        argv += ["--backends", backends]
        name = "bare-aiohttp-proxy"
        p = self.start(Proc(name, argv, f"http://127.0.0.1:{port}"), env=self.env())
        wait_post_ok(p.url, proc=p)
        return Target(name, p.url, [p], BARE_PROXY_NOTE)

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
            # Its own metrics port: the default (29000) is taken when two benches run at once.
            "--prometheus-port",
            str(free_port()),
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
