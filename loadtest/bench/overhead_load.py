"""The overhead benchmark's load generators (wrk with a Lua script, or in-process aiohttp)
and the CPU accounting of the processes under test."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

CHAT_PATH = "/v1/chat/completions"
MODEL = "trivial"


def request_body(stream: bool) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "stream": stream,
    }
    return json.dumps(body, separators=(",", ":")).encode()


# ------------------------------------------------------------------ process accounting


def _children(pid: int) -> list[int]:
    """All descendants of `pid` (uvicorn workers, launcher children), from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """user + system CPU seconds of these processes and all their descendants (threads included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    seen: set[int] = set()
    for root in pids:
        for p in _children(root):
            if p in seen:
                continue
            seen.add(p)
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


# ------------------------------------------------------------------ load generators


@dataclass
class Load:
    requests: int
    errors: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    events: int = 0  # SSE events counted by the generator itself (python generator only)

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


WRK_LUA = """
wrk.method = "POST"
wrk.body = [[{body}]]
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("KVBENCH %d %d %d %d %d\\n", summary.requests, summary.duration,
    latency:percentile(50), latency:percentile(99), e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def find_wrk() -> str | None:
    return shutil.which("wrk")


def run_wrk(
    wrk: str,
    url: str,
    body: bytes,
    concurrency: int,
    duration_s: float,
    workdir: Path,
    threads: int = 1,
) -> Load:
    script = workdir / f"post-{abs(hash(body))}.lua"
    if not script.exists():
        script.write_text(WRK_LUA.replace("{body}", body.decode()))
    argv = [
        wrk,
        f"-t{min(threads, concurrency)}",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        url,
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("KVBENCH "):
            n, dur_us, p50, p99, errs = (int(x) for x in line.split()[1:])
            return Load(n, errs, dur_us / 1e6, p50 / 1000, p99 / 1000)
    raise RuntimeError(
        f"wrk printed no summary (rc {out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}"
    )


async def post_ok(
    session: aiohttp.ClientSession, sem: asyncio.Semaphore, url: str, body: bytes, what: str
) -> None:
    """POST one chat body to ``url`` under ``sem``; anything but a 200 ends the run (``what``)."""
    async with (
        sem,
        session.post(url + CHAT_PATH, data=body, headers={"content-type": "application/json"}) as r,
    ):
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"{what}: HTTP {r.status}: {(await r.text())[:200]}")


async def run_python_load(url: str, body: bytes, concurrency: int, duration_s: float) -> Load:
    """Closed loop: `concurrency` keep-alive connections, each sending the next request on answer."""
    lat: list[float] = []
    errors = 0
    events = 0
    headers = {"Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=30)
    ) as session:
        start = time.perf_counter()
        deadline = start + duration_s

        async def worker() -> None:
            nonlocal errors, events
            while True:
                t0 = time.perf_counter()
                if t0 >= deadline:
                    return
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        data = await resp.read()
                        if resp.status != 200:
                            errors += 1
                            continue
                        events += data.count(b"data:")
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        dur = time.perf_counter() - start
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    return Load(len(lat), errors, dur, pct(0.5), pct(0.99), events)
