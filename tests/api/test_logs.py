"""JSON logs carry the request id as a field and never the Authorization header."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from loadtest.local_fleet import EngineSpec, free_port, gateway_config, wait_http
from proxy.api.logs import JsonFormatter
from tests.support.engines import start_engine


def test_json_log_line_has_request_id_field() -> None:
    rec = logging.LogRecord(
        "kvroute.gateway", logging.INFO, __file__, 1, "request %s diverted", ("r1",), None
    )
    rec.request_id = "r1"
    rec.backend = "node-a"
    line = orjson.loads(JsonFormatter().format(rec))
    assert line["msg"] == "request r1 diverted"
    assert line["request_id"] == "r1" and line["backend"] == "node-a" and line["level"] == "info"


SECRET = "sk-kvroute-test-4b1d9e"
WRONG = "sk-wrong-key-77c0aa"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_authorization_never_appears_in_any_log_output(fmt: str, tmp_path: Path) -> None:
    """The real gateway process at debug level, every line it writes (its own logs, uvicorn's
    access log, tracebacks): neither the accepted key nor a rejected one may appear."""
    engine = start_engine("thread", name="log-engine")
    cfg = gateway_config(
        [(EngineSpec(name="log-engine"), engine.url)],
        auth={"api_keys": [SECRET]},
        collector={"scrape_interval_s": 0.1},
    )
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(cfg))
    port = free_port()
    out = tmp_path / "gateway.log"
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path), "--port", str(port)]
    argv += ["--log-level", "debug", "--log-format", fmt]
    url = f"http://127.0.0.1:{port}"
    with out.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_http(url + "/health", timeout_s=30, proc=proc)
            good = {"Authorization": f"Bearer {SECRET}"}
            body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
                assert c.post("/v1/chat/completions", json=body, headers=good).status_code == 200
                streamed = c.post(
                    "/v1/chat/completions", json={**body, "stream": True}, headers=good
                )
                assert streamed.status_code == 200
                wrong = {"Authorization": f"Bearer {WRONG}"}
                assert c.post("/v1/chat/completions", json=body, headers=wrong).status_code == 401
                assert c.post("/v1/chat/completions", content=b"{", headers=good).status_code == 400
                engine.fault("error500")  # a failure path: the gateway logs a warning
                assert c.post("/v1/chat/completions", json=body, headers=good).status_code >= 500
                engine.fault("none")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
            engine.stop()
    text = out.read_text(errors="replace")
    assert "log-engine" in text and "failed" in text, text[-2000:]  # the logs were captured
    assert SECRET not in text and WRONG not in text
    assert "Bearer" not in text
