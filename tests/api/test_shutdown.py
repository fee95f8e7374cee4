"""Shutdown keeps its promise: SIGTERM to a real ``kvroute serve`` drains, then ends what is left.

Black box: the real CLI as a process, a simulated engine at real speed (50 tokens/s, so a
stream of N tokens lasts N/50 s), real HTTP clients. The drain time of the second test is
short on purpose; nothing here depends on how fast the machine is: each stream is read to its
end, and each wait is for a condition.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from loadtest.local_fleet import EngineSpec, Proc, free_port, gateway_config, wait_http
from tests.support.gateway import wait_until

DECODE_TOKENS_PER_S = 50.0


def _serve_argv(cfg_path: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "proxy.cli", "serve", "--config", str(cfg_path),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "info", *extra,
    ]  # fmt: skip


@pytest.fixture
def slow_engine(engine_factory: Any) -> Any:
    return engine_factory(speedup=1.0, decode_tokens_per_s=DECODE_TOKENS_PER_S)


@pytest.fixture
def gateway(tmp_path: Path, slow_engine: Any) -> Iterator[Any]:
    """``start(*extra_args) -> (proc, url)``: a real ``kvroute serve`` on the slow engine."""
    started: list[Proc] = []

    def start(*extra: str, client: str = "lean") -> tuple[Proc, str]:
        cfg = tmp_path / "kvroute.yaml"
        data = gateway_config([(EngineSpec("b0"), slow_engine.url)], upstream={"client": client})
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        port = free_port()
        proc = Proc("gateway", _serve_argv(cfg, port, *extra), f"http://127.0.0.1:{port}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        proc.start(env=env, log_dir=tmp_path)
        started.append(proc)
        assert proc.popen is not None
        # /health is 2xx once the backend's first scrape is in: a request will be routed.
        wait_http(proc.url + "/health", timeout_s=60, proc=proc.popen)
        return proc, proc.url

    yield start
    for p in started:
        p.stop(timeout_s=30)


def _events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


def _never_ready(url: str) -> bool:
    """True once a new connection is refused; fails if /ready ever answers 200 on the way."""
    try:
        r = httpx.get(url + "/ready", timeout=5)
    except httpx.ConnectError:
        return True
    assert r.status_code == 503 and r.json() == {"status": "draining"}, r.text
    return False


def _stream(url: str, max_tokens: int) -> Any:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    return httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60)


def test_ready_answers_200_while_serving(gateway: Any) -> None:
    _, url = gateway()
    r = httpx.get(url + "/ready", timeout=5)
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_sigterm_mid_stream_lets_the_stream_finish(gateway: Any) -> None:
    proc, url = gateway()
    max_tokens = 150  # 3 s at 50 tokens/s: well inside the default drain time (600 s)
    with _stream(url, max_tokens) as r:
        assert r.status_code == 200
        events = _events(r.iter_lines())
        first = orjson.loads(next(events))
        assert first["object"] == "chat.completion.chunk"
        proc.popen.send_signal(signal.SIGTERM)
        # The gateway leaves the pool at once: /ready is never 200 again.
        wait_until(lambda: _never_ready(url), timeout_s=30, what="the listener to close")
        rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in rest[:-1]]
    assert all("error" not in c for c in chunks), chunks[-2:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.popen.wait(timeout=60) == 0


@pytest.mark.parametrize("client", ["lean", "aiohttp"])
def test_a_stream_longer_than_the_drain_ends_with_a_final_error_event(
    gateway: Any, client: str
) -> None:
    # Both upstream clients' readers must wake up for the interruption (upstream.client).
    proc, url = gateway("--drain-s", "1", client=client)
    # 20 s at 50 tokens/s: far longer than the 1 s drain.
    with _stream(url, 1000) as r:
        assert r.status_code == 200
        events = _events(r.iter_lines())
        assert orjson.loads(next(events))["object"] == "chat.completion.chunk"
        proc.popen.send_signal(signal.SIGTERM)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    last = orjson.loads(rest[-2])
    assert last["error"]["code"] == "gateway_shutting_down", last
    assert last["error"]["type"] == "server_error"
    # It was cut, not finished: no chunk says the generation ended.
    assert not any(
        c.get("choices") and c["choices"][0].get("finish_reason")
        for c in map(orjson.loads, rest[:-2])
    )
    assert proc.popen.wait(timeout=60) == 0
    log = proc.log_path.read_text() if proc.log_path else ""
    assert "drain time (1s) over; ending 1 stream" in log, log[-2000:]


def test_a_drain_time_that_is_not_positive_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(yaml.safe_dump(gateway_config([(EngineSpec("b0"), "http://127.0.0.1:9")])))
    done = subprocess.run(
        _serve_argv(cfg, free_port(), "--drain-s", "0"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--drain-s 0: must be more than 0" in done.stderr
