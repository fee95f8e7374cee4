"""What the benchmarks on vLLM-mode engines share: start the engines, the routers, read counters.

The queueing, memory-pressure and disaggregation benchmarks each started simulated vLLM
engines, ``kvroute serve`` and vllm-router alike, and read the engines' Prometheus counters
alike; one copy here keeps their setups comparable (a fix to a start on a loaded machine
reaches all of them).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.local_fleet import free_port

MODEL = "sim-model"
_PROBE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def start_vllm_engine(
    name: str, flags: Sequence[str], behaviour: str = "vllm"
) -> tuple[subprocess.Popen[str], str]:
    """``kvroute engine --behaviour vllm`` (or another dialect) on a free port with ``flags``;
    its URL once it listens."""
    argv = [sys.executable, "-m", "proxy.cli", "engine", "--behaviour", behaviour, "--port", "0"]
    argv += ["--name", name, "--model", MODEL, *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"engine {name} did not start: {line!r}")
    return proc, line.split("listening on ", 1)[1].strip()


# Every benchmark engine decodes 30 tokens/s per request (before ``--speedup``).
DECODE_TOKENS_PER_S = 30


def engine_flags(
    capacity: int, prefill: float, speedup: float, max_num_seqs: int, *extra: str
) -> list[str]:
    """The flags every benchmark engine takes: KV size, 16-token blocks, rates, slots."""
    flags = ["--capacity-tokens", str(capacity), "--block-size", "16"]
    flags += [
        "--prefill-tokens-per-s",
        str(prefill),
        "--decode-tokens-per-s",
        str(DECODE_TOKENS_PER_S),
    ]
    flags += ["--speedup", str(speedup), "--max-num-seqs", str(max_num_seqs)]
    return [*flags, *extra]


def counter(url: str, name: str) -> float:
    """A counter's value summed over its labels (``name`` or ``name_total``) from ``url/metrics``."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name in (name, name + "_total")
    )


def start_gateway(cfg: dict[str, Any], workdir: Path) -> tuple[subprocess.Popen[str], str]:
    """``kvroute serve`` as deployed; ready once every backend has reported.

    Two minutes: on a shared, loaded box a start took longer than 30 s (a row was lost).
    """
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)]
    with (workdir / "gateway.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{cfg['listen']['port']}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            fleet = httpx.get(url + "/fleet", timeout=2).json()["backends"]
            if all(b["report"] for b in fleet):
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    proc.kill()
    tail = (workdir / "gateway.log").read_text()[-400:]
    raise RuntimeError(f"gateway did not start: {tail!r}")


def start_vllm_router(
    exe: str, policy: str, workers: Sequence[str], workdir: Path
) -> tuple[subprocess.Popen[str], str]:
    """vllm-router with ``workers`` (``--worker-urls ...`` or its PD flags), on free ports.

    Its Prometheus exporter binds 127.0.0.1:29000 by default: a second vllm-router on the
    machine made it panic at start ("Address already in use"), so it gets a free port too.
    """

    def argv(port: int) -> list[str]:
        out = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
        return [*out, "--prometheus-port", str(free_port()), "--log-level", "warning", *workers]

    return start_router(f"vllm-router --policy {policy}", argv, workdir)


def start_sglang_router(
    policy: str, workers: Sequence[str], workdir: Path
) -> tuple[subprocess.Popen[str], str]:
    """SGLang's own router (the ``sglang-router`` package) with ``workers`` (its PD flags).

    Its Prometheus exporter gets a free port, as vllm-router's does (29000 by default too).
    """

    def argv(port: int) -> list[str]:
        out = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        out += ["--port", str(port), "--policy", policy, "--prometheus-port", str(free_port())]
        return [*out, "--log-level", "warn", *workers]

    return start_router(f"sglang-router --policy {policy}", argv, workdir)


def start_router(
    label: str, argv: Callable[[int], list[str]], workdir: Path
) -> tuple[subprocess.Popen[str], str]:
    """A peer router from ``argv(port)``: ready once a real request gets a 200 through it;
    tried three times on fresh ports."""
    log_path = workdir / (label.replace(" ", "").replace("--policy", "-") + ".log")
    for _attempt in range(3):
        port = free_port()
        with log_path.open("w") as log:
            proc = subprocess.Popen(argv(port), stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if (
                    httpx.post(url + "/v1/chat/completions", json=_PROBE, timeout=2).status_code
                    == 200
                ):
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        proc.kill()
        proc.wait(10)
    tail = log_path.read_text()[-400:] if log_path.exists() else ""
    raise RuntimeError(f"{label} did not serve: {tail!r}")
