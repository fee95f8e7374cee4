"""Load for the big-prompt benchmark: the request bodies, wrk cycling them, and lone prompts.

The bodies are written to files once and wrk's Lua reads them at start, so the load
generator costs the same (C and LuaJIT, no Python) against every target; a Python client
pushing 220 KB bodies at 150 connections would itself take a core of the two.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from loadtest.bench.overhead_load import CHAT_PATH, MODEL, Load
from loadtest.workload import make_prompt

#: The issue's document: ~220 KB of text (about 50,000 cl100k tokens of common words).
DOC_CHARS = 220_000

WRK_BODIES_LUA = """
local bodies = {}
local i = 0
function init(args)
  for n = 1, %(count)d do
    local f = io.open(string.format("%(dir)s/body-%%d.json", n - 1), "rb")
    bodies[n] = f:read("*a")
    f:close()
  end
end
request = function()
  i = i + 1
  return wrk.format("POST", "%(path)s", {["Content-Type"] = "application/json"},
    bodies[(i %% #bodies) + 1])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVBENCH %%d %%d %%d %%d %%d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def document(seed: int, chars: int = DOC_CHARS) -> str:
    """``chars`` characters of random common words (distinct seeds: distinct documents)."""
    text = make_prompt(chars // 3, random.Random(seed))
    while len(text) < chars:
        text += " " + make_prompt(chars // 3, random.Random(seed + len(text)))
    return text[:chars].rsplit(" ", 1)[0]


def chat_body(content: str, max_tokens: int = 16) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        }
    )


def shared_document_bodies(count: int, chars: int = DOC_CHARS) -> list[bytes]:
    """The issue's case: a distinct first line, then the same document, in each body."""
    doc = document(0, chars)
    return [chat_body(f"Question {i}: what does section {i} say?\n{doc}") for i in range(count)]


def unique_document_bodies(count: int, chars: int = DOC_CHARS) -> list[bytes]:
    """Its variant: every body a different document."""
    return [chat_body(f"Question {i}?\n{document(1000 + i, chars)}") for i in range(count)]


def write_bodies(bodies: list[bytes], workdir: Path, name: str) -> Path:
    """The bodies as files plus the wrk script that cycles them; returns the script."""
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    for i, b in enumerate(bodies):
        (folder / f"body-{i}.json").write_bytes(b)
    script = folder / "bodies.lua"
    values = {"count": len(bodies), "dir": str(folder), "path": CHAT_PATH}
    script.write_text(WRK_BODIES_LUA % values)
    return script


def run_wrk_bodies(
    wrk: str, url: str, script: Path, concurrency: int, duration_s: float, threads: int = 2
) -> Load:
    """wrk at ``concurrency`` keep-alive connections, each request the next body in turn."""
    argv = [
        wrk,
        f"-t{min(threads, concurrency)}",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "20s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 90, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("KVBENCH "):
            n, dur_us, p50, p99, errs = (int(x) for x in line.split()[1:])
            return Load(n, errs, dur_us / 1e6, p50 / 1000, p99 / 1000)
    raise RuntimeError(f"wrk printed no summary (rc {out.returncode}): {out.stderr[-500:]}")


@dataclass
class Lone:
    """Client-measured latency of lone requests (one at a time, one connection) per target."""

    p50_ms: dict[str, float]
    mean_ms: dict[str, float]
    requests: int


def send_each(url: str, bodies: list[bytes]) -> None:
    """Every body once, one after another (``--warm``: what a first pass of the clients leaves)."""
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=60.0) as client:
        for body in bodies:
            client.post(CHAT_PATH, content=body, headers=headers).raise_for_status()


def lone_latency(urls: dict[str, str], bodies: list[bytes], rounds: int = 1) -> Lone:
    """Each body sent alone to every target in turn (interleaved, so drift hits all alike).

    One warm-up request per target first (connections, the gateway's first-use paths).
    """
    times: dict[str, list[float]] = {name: [] for name in urls}
    clients = {name: httpx.Client(base_url=url, timeout=30.0) for name, url in urls.items()}
    headers = {"content-type": "application/json"}
    try:
        for client in clients.values():
            client.post(CHAT_PATH, content=chat_body("warm up"), headers=headers).raise_for_status()
        for _ in range(rounds):
            for body in bodies:
                for name, client in clients.items():
                    t0 = time.perf_counter()
                    r = client.post(CHAT_PATH, content=body, headers=headers)
                    took = time.perf_counter() - t0
                    r.raise_for_status()
                    times[name].append(took * 1000)
    finally:
        for c in clients.values():
            c.close()
    return Lone(
        {n: statistics.median(t) for n, t in times.items()},
        {n: statistics.fmean(t) for n, t in times.items()},
        len(bodies) * rounds,
    )
