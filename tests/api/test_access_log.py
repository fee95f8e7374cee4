"""The optional access log: one line per /v1 request with the fields operators ask for."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.gateway import fleet_state, gateway_cfg, run_gateway, wait_until

BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def access_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvroute.access"]


@pytest.mark.parametrize("enabled", [True, False])
def test_access_log(
    enabled: bool, engine_factory: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_factory(name="e1")
    cfg = gateway_cfg(
        [{"name": "e1", "url": engine.url, "kind": "contiguous"}], log={"access_log": enabled}
    )
    caplog.set_level(logging.INFO, logger="kvroute.access")
    with run_gateway(cfg) as url:
        wait_until(lambda: fleet_state(url)["backends"][0]["report"] is not None)
        ok = httpx.post(
            url + "/v1/chat/completions",
            json=BODY,
            headers={"x-request-id": ("req-1 evil" + "x" * 300).encode()},
            timeout=10,
        )
        assert ok.status_code == 200
        bad = httpx.post(url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
        assert bad.status_code == 400
        httpx.get(url + "/health", timeout=5)
    lines = access_lines(caplog)
    if not enabled:
        assert lines == []
        return
    assert len(lines) == 2  # /health is not an inference request
    first = lines[0].getMessage()
    # Client-sent ids are bounded and made printable: one token per field.
    assert first.startswith("/v1/chat/completions id=req-1")
    assert "model=sim-model class=short" in first
    ident = first.split("id=")[1].split()[0]
    assert 5 < len(ident) <= 128 and " " not in ident
    for field in ("backend=e1", "attempts=1", "status=200", "duration_ms="):
        assert field in first
    demand = int(first.split("demand=")[1].split()[0])
    assert demand == int(ok.headers["x-kvroute-demand-tokens"])
    assert "model=m " in lines[1].getMessage() and "status=400" in lines[1].getMessage()
