"""Through the real gateway: vLLM-mode engines are never over-admitted into preemption.

Each engine holds two requests at full demand. Eight arrive at once. A vLLM server shows only
the prompts' blocks at first, so a gateway that took the reported free space at face value
would send four or more to each engine, and vLLM would preempt when their decode outgrew the
cache. With every in-flight request counted at its full demand, the gateway holds the rest
in its admission queue instead: no preemption, every request served.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from proxy.backends.registry import adapter_for
from tests.support.gateway import gateway_cfg, run_gateway, wait_until

BS = 16
CAPACITY = 2_048  # per engine: two requests of ~990 tokens


def start_engine(name: str) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "proxy.cli", "engine", "--behaviour", "vllm", "--port", "0"]
    argv += ["--name", name, "--model", "m", "--capacity-tokens", str(CAPACITY)]
    argv += ["--block-size", str(BS), "--decode-tokens-per-s", "50", "--speedup", "10"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split("listening on ", 1)[1].strip()


@pytest.fixture
def engines() -> Iterator[list[str]]:
    procs = [start_engine(f"v{i}") for i in range(2)]
    try:
        yield [url for _, url in procs]
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=10)


def preemptions(url: str) -> int:
    return adapter_for("vllm").parse_metrics(httpx.get(f"{url}/metrics").text, 0.0).preemptions


def test_no_preemption_when_the_gateway_says_it_fits(engines: list[str]) -> None:
    backends = [{"name": f"v{i}", "url": u, "kind": "vllm"} for i, u in enumerate(engines)]
    cfg = gateway_cfg(backends, queue={"max_wait_s": 60.0})
    with run_gateway(cfg) as gw:
        wait_until(
            lambda: all(b.get("report") for b in httpx.get(gw + "/fleet").json()["backends"]),
            what="both engines reported",
        )
        body = {"model": "m", "prompt": "one two three four " * 25, "max_tokens": 880}

        def call(_: int) -> int:
            return httpx.post(gw + "/v1/completions", json=body, timeout=120).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(call, range(8)))
    assert statuses == [200] * 8
    assert [preemptions(u) for u in engines] == [0, 0]
