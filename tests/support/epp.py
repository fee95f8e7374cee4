"""kvroute's endpoint picker in-process (the gateway app on uvicorn in a thread, the EPP's
gRPC servers on that app's loop), and a tap that records what crosses the upstream wire.

The tap is a small reverse proxy in front of a simulated engine: it records each inference
request's body as the upstream received it and each answer's bytes as the upstream sent
them, so a test compares the client's bytes with the upstream's, both ends of Envoy.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from loadtest.local_fleet import free_port
from proxy.api.app import create_app
from proxy.config import Config
from proxy.epp.server import EppOptions, EppServer, attach
from tests.support.gateway import serve_app
from tests.support.threaded_app import ThreadedApp

# Framing the tap sets itself on each side.
_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass
class Epp:
    """The running EPP: its ext_proc port, the gateway app's URL, and the app."""

    url: str
    server: EppServer
    app: Any

    @property
    def port(self) -> int:
        return self.server.ports[0]

    @property
    def health_port(self) -> int:
        return self.server.ports[1]


@contextmanager
def run_epp(cfg: Config, **app_kw: Any) -> Iterator[Epp]:
    app = create_app(cfg, **app_kw)
    server = attach(app, EppOptions("127.0.0.1", 0, 0, grace_s=1.0))
    with serve_app(app, cfg) as url:
        deadline = time.monotonic() + 10
        while server.ports == (0, 0):
            if time.monotonic() > deadline:
                raise RuntimeError("the EPP did not start")
            time.sleep(0.02)
        yield Epp(url, server, app)


@dataclass
class Exchange:
    """One inference request as the upstream saw it."""

    request: bytes
    answer: bytearray = field(default_factory=bytearray)


class Tap(ThreadedApp):
    """Relays everything to ``target``; records inference requests and their answers."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.exchanges: list[Exchange] = []
        self._session: aiohttp.ClientSession | None = None

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        body = await request.read()
        inference = request.path.startswith("/v1/") and request.method == "POST"
        record = Exchange(body)
        if inference:
            self.exchanges.append(record)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as upstream:
            resp = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    resp.headers[k] = v
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                if inference:
                    record.answer += chunk
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    def stop(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            asyncio.run_coroutine_threadsafe(session.close(), self._loop).result(10)
        super().stop()

    def start(self) -> Tap:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self.serve(app)
        return self


@dataclass
class EppProcess:
    """``kvroute epp`` as a process of its own (a test may SIGKILL it)."""

    popen: subprocess.Popen[bytes]
    url: str
    port: int

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(10)


@contextmanager
def epp_process(data: dict[str, Any], tmp: Path) -> Iterator[EppProcess]:
    """Start ``python -m proxy.epp.main`` over the config ``data``; ready once ``/ready`` says so."""
    config = tmp / "kvroute.yaml"
    # JSON is YAML.
    config.write_text(json.dumps(data))
    http, grpc_port, health = free_port(), free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "proxy.epp.main",
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(http),
        "--grpc-host",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--health-port",
        str(health),
        "--log-level",
        "warning",
    ]
    log = (tmp / "epp.log").open("w")
    popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if popen.poll() is not None:
                raise RuntimeError(f"kvroute epp exited: {(tmp / 'epp.log').read_text()[-3000:]}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvroute epp did not get ready")
            time.sleep(0.05)
        yield EppProcess(popen, url, grpc_port)
    finally:
        if popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(15)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
        log.close()
