"""A backend that drops the connection after taking the request is "broken", not "connect_error".

Logs and kvroute_attempts_total{result} used to call a mid-answer disconnect a connect
error, which sends an operator to check addresses instead of a crashing server.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import gateway_cfg, run_gateway


@pytest.fixture
def hangup_backend() -> Iterator[str]:
    """Accepts, reads the request, closes without a byte of answer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        srv.close()


def test_hangup_is_broken_not_connect_error(hangup_backend: str) -> None:
    cfg = gateway_cfg(
        [{"name": "hangup", "url": hangup_backend}],
        retry={"max_attempts": 1},
        health={"active": {"enabled": False}},
    )
    with run_gateway(cfg, run_collector=False) as url:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        metrics = httpx.get(url + "/metrics", timeout=5).text
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_broken"
    assert "closed the connection before answering" in r.json()["error"]["message"]
    attempts = [line for line in metrics.splitlines() if line.startswith("kvroute_attempts_total{")]
    assert any('result="broken"' in line and not line.endswith(" 0.0") for line in attempts), (
        attempts
    )
    assert not any(
        'result="connect_error"' in line and not line.endswith(" 0.0") for line in attempts
    )
