"""Run the real gateway app on uvicorn in a background thread, as httpx's own tests do."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from loadtest.local_fleet import free_port
from proxy.api.app import create_app
from proxy.api.server import server_config
from proxy.config import Config, parse_config


class ThreadedServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


@contextmanager
def run_gateway(cfg: Config, **app_kw: Any) -> Iterator[str]:
    with serve_app(create_app(cfg, **app_kw), cfg) as url:
        yield url


@contextmanager
def serve_app(app: Any, cfg: Config) -> Iterator[str]:
    """Serve an app already built (a test that needs ``app.state``) with the gateway's server settings."""
    port = free_port()
    server = ThreadedServer(
        server_config(
            app, cfg, "127.0.0.1", port, log_level="warning", loop="asyncio", lifespan="on"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(15)


def gateway_cfg(backends: list[dict[str, Any]], **sections: Any) -> Config:
    pools = {b.get("pool", "general") for b in backends} | {"general"}
    data: dict[str, Any] = {
        "pools": {p: {"role": "long" if p == "long" else "general"} for p in pools},
        "backends": backends,
        "collector": {"scrape_interval_s": 0.1, "stale_after_s": 2.0},
        "queue": {"max_wait_s": 0.5},
        # The simulated engines answer any model name; most tests send "m". Tests of model
        # routing set "reject" (the shipped default) themselves.
        "routing": {"unknown_model": "pass_through"},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return parse_config(data, "test", environ={})


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def fleet_state(url: str) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(url + "/fleet", timeout=5).json()
    return data


def fleet_backends(url: str) -> list[dict[str, Any]]:
    """``/fleet``'s backends, in the gateway's order."""
    got: list[dict[str, Any]] = fleet_state(url)["backends"]
    return got


def all_reported(url: str, n: int) -> bool:
    """Exactly ``n`` backends have a memory report (the gateway has scraped them all)."""
    return sum(1 for b in fleet_backends(url) if b["report"]) == n


@pytest.fixture
def gateway_runner() -> Callable[..., Any]:
    return run_gateway


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)
