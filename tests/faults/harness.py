"""The fault suite's harness: a fleet of real processes, a bounded load, and a strict tally.

Everything runs as it would in production, as separate processes on 127.0.0.1: a real
``redis-server``, simulated engines (``python -m loadtest.engine.server``) and the gateway
(``python -m proxy.cli serve``). Faults are injected with signals (SIGKILL, SIGSTOP,
SIGTERM) and the engines' ``/admin/fault`` switch while a bounded load runs.

Every answer is put in exactly one bucket:

* ``ok``: a complete, well-formed answer (a JSON completion, or an SSE stream that ends
  with ``data: [DONE]`` and carries no error event);
* ``failed``: a well-formed error: an OpenAI-format error body, or an SSE stream whose last
  event before ``[DONE]`` is an OpenAI-format error; its code is recorded so a test can
  check that it is the right one for the fault;
* ``lost``: anything else: no answer at all (reset, client timeout), a truncated stream, a
  2xx with a body that is not a completion, an error that is not in the OpenAI format.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.local_fleet import EngineSpec, Proc, engine_proc, free_port, gateway_config, wait_http
from loadtest.workload import make_prompt
from tests.support.redis_server import RedisInstance

#: Per-scenario counts, filled by the tests and printed by the conftest at the end.
RESULTS: dict[str, dict[str, Any]] = {}
CLIENT_TIMEOUT_S = 30.0  # far above any answer the suite expects: a hung gateway shows up as lost
#: The suite's reservation TTL: far longer than any leak check waits (LEAK_CHECK_S), so a
#: reservation that is never released is still there when the check looks, instead of
#: expiring while it waits (with 8 s against 20 s, removing a release left every scenario green).
RESERVATION_TTL_S = 600.0
#: How long a leak check waits for background releases to land (one Redis round trip each).
LEAK_CHECK_S = 10.0
#: A replica that is killed on purpose holds reservations that only their TTL can end: it
#: gets a short one, so the check can wait them out while the survivor's stay long.
KILLED_REPLICA_TTL_S = 3.0
PROMPT = make_prompt(60)


def fault_config(**overrides: Any) -> dict[str, Any]:
    """Gateway settings for the suite: short timeouts and ejections so each scenario takes seconds."""
    cfg: dict[str, Any] = {
        "upstream": {
            "connect_timeout_s": 1.0,
            "ttfb_timeout_s": 2.0,
            "idle_timeout_s": 2.0,
            "total_timeout_s": 20.0,
        },
        "health": {
            "active": {"interval_s": 0.25, "timeout_s": 0.5, "rise": 2, "fall": 2},
            "outlier": {"consecutive_failures": 3, "base_ejection_s": 1.0, "max_ejection_s": 3.0},
        },
        # The suite's load is a handful of clients: a budget of 20% of 8 would be one retry.
        # The budget's own behaviour is tested separately (test_fault_retry_budget).
        "retry": {"max_attempts": 3, "budget_min_concurrency": 16},
        "store": {
            "op_timeout_s": 0.1,
            "breaker_open_s": 0.5,
            "reservation_ttl_s": RESERVATION_TTL_S,
            "max_snapshot_age_s": 1.0,
        },
        "collector": {"scrape_interval_s": 0.25, "stale_after_s": 2.0, "timeout_s": 0.5},
        "queue": {"max_wait_s": 2.0},
    }
    for section, values in overrides.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@dataclass
class Tally:
    """What happened to every request of one load run."""

    sent: int = 0
    ok: int = 0
    failed: int = 0
    lost: int = 0
    failed_codes: Counter[str] = field(default_factory=Counter)
    lost_details: list[str] = field(default_factory=list)
    backends: Counter[str] = field(default_factory=Counter)

    def add(self, bucket: str, detail: str = "", backend: str = "") -> None:
        self.sent += 1
        if bucket == "ok":
            self.ok += 1
            if backend:
                self.backends[backend] += 1
        elif bucket == "failed":
            self.failed += 1
            self.failed_codes[detail] += 1
        else:
            self.lost += 1
            if len(self.lost_details) < 20:
                self.lost_details.append(detail)

    def merge(self, other: Tally) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.failed += other.failed
        self.lost += other.lost
        self.failed_codes.update(other.failed_codes)
        self.lost_details.extend(other.lost_details[: max(0, 20 - len(self.lost_details))])
        self.backends.update(other.backends)

    def summary(self) -> str:
        codes = dict(self.failed_codes)
        return f"sent={self.sent} ok={self.ok} failed={self.failed} {codes} lost={self.lost} {self.lost_details[:5]}"


def body(stream: bool, max_tokens: int = 24, prompt: str = PROMPT) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def error_code(payload: Any) -> str | None:
    """The code of an OpenAI-format error object, or None when it is not one."""
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return None
    err = payload["error"]
    if (
        not isinstance(err.get("message"), str)
        or not err["message"]
        or not isinstance(err.get("type"), str)
    ):
        return None
    code = err.get("code")
    return str(code) if code is not None else str(err["type"])


def judge_json(status: int, raw: bytes) -> tuple[str, str]:
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "lost", f"HTTP {status} with a body that is not JSON: {raw[:80]!r}"
    if status == 200:
        if (
            isinstance(payload, dict)
            and isinstance(payload.get("choices"), list)
            and payload["choices"]
        ):
            return "ok", ""
        return "lost", f"HTTP 200 without choices: {raw[:80]!r}"
    code = error_code(payload)
    if code is None:
        return "lost", f"HTTP {status} not in the OpenAI error format: {raw[:80]!r}"
    return "failed", f"{status}:{code}"


def judge_sse(raw: bytes) -> tuple[str, str]:
    events = [e for e in raw.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    datas = [
        line[5:].strip() for e in events for line in e.split(b"\n") if line.startswith(b"data:")
    ]
    if not datas or datas[-1] != b"[DONE]":
        return "lost", f"stream without a final [DONE] ({len(datas)} events): {raw[-80:]!r}"
    content = 0
    for d in datas[:-1]:
        try:
            obj = orjson.loads(d)
        except orjson.JSONDecodeError:
            return "lost", f"stream event that is not JSON: {d[:80]!r}"
        code = error_code(obj)
        if code is not None:
            return "failed", f"stream:{code}"
        if isinstance(obj, dict) and obj.get("choices"):
            content += 1
    return ("ok", "") if content else ("lost", "stream with no content events")


async def send(
    client: httpx.AsyncClient, url: str, req: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[str, str, str]:
    """One request; returns (bucket, detail, backend). Never raises."""
    path = url + "/v1/chat/completions"
    try:
        if req.get("stream"):
            async with client.stream("POST", path, json=req, headers=headers) as resp:
                raw = await resp.aread()
                backend = resp.headers.get("x-kvroute-backend", "")
                if resp.status_code == 200 and resp.headers.get("content-type", "").startswith(
                    "text/event-stream"
                ):
                    bucket, detail = judge_sse(raw)
                else:
                    bucket, detail = judge_json(resp.status_code, raw)
                return bucket, detail, backend
        resp = await client.post(path, json=req, headers=headers)
        bucket, detail = judge_json(resp.status_code, resp.content)
        return bucket, detail, resp.headers.get("x-kvroute-backend", "")
    except httpx.HTTPError as exc:
        return "lost", f"no answer: {exc.__class__.__name__}: {exc}", ""


def new_client(concurrency: int = 32) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=5.0),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        trust_env=False,
    )


async def run_load(
    url: str | Callable[[], str],
    seconds: float,
    workers: int = 8,
    stream_share: float = 0.5,
    max_tokens: int = 24,
    tally: Tally | None = None,
    sender: Callable[[httpx.AsyncClient, dict[str, Any]], Any] | None = None,
) -> Tally:
    """Closed-loop load: ``workers`` clients send back to back for ``seconds`` (bounded)."""
    tally = tally or Tally()
    stop_at = time.monotonic() + seconds
    async with new_client(workers * 2) as client:

        async def worker(w: int) -> None:
            # A seeded draw per request: the share holds from the first requests on (the old
            # "(w + i) % 100 < 50" made every request of a short run a stream, so no scenario
            # ever sent a non-streamed one).
            rng = random.Random(w)
            i = 0
            while time.monotonic() < stop_at:
                stream = rng.random() < stream_share
                req = body(stream=stream, max_tokens=max_tokens)
                if sender is not None:
                    bucket, detail, backend = await sender(client, req)
                else:
                    target = url() if callable(url) else url
                    bucket, detail, backend = await send(client, target, req)
                tally.add(bucket, detail, backend)
                i += 1

        await asyncio.gather(*(worker(w) for w in range(workers)))
    return tally


async def after(seconds: float, action: Callable[[], Any]) -> None:
    """Run a blocking fault action (signal, HTTP call) off the loop after a delay."""
    await asyncio.sleep(seconds)
    await asyncio.to_thread(action)


def wait_for(
    pred: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception as exc:  # a process still coming up
            last = exc
        time.sleep(interval_s)
    raise AssertionError(
        f"timed out after {timeout_s}s waiting for {what}"
        + (f" (last error: {last!r})" if last else "")
    )


def metric_values(url: str, name: str) -> dict[str, float]:
    """``{backend label (or ""): value}`` of one metric family on a gateway's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                out[s.labels.get("backend", "")] = s.value
    return out


def counter_total(url: str, name: str) -> float:
    """The sum over every label set of one counter on a gateway's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == name
        for s in fam.samples
        if s.name == name + "_total"
    )


class FaultFleet:
    """Redis + engines + gateway replicas, all real processes sharing one Redis."""

    def __init__(
        self,
        n_engines: int = 3,
        speedup: float = 10.0,
        pools: Sequence[str] | None = None,
        **overrides: Any,
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="kvroute-faults-"))
        self.redis = RedisInstance(self.workdir / "redis")
        (self.workdir / "redis").mkdir()
        pools = list(pools) if pools is not None else ["general"] * n_engines
        self.specs = [
            EngineSpec(name=f"e{i}", pool=pool, speedup=speedup) for i, pool in enumerate(pools)
        ]
        self.engines: list[Proc] = []
        self.gateways: list[Proc] = []
        self.overrides = overrides
        self.config_path = self.workdir / "kvroute.yaml"
        self.prefix = "kvroute"

    # ------------------------------------------------------------- processes
    def start(self) -> FaultFleet:
        self.redis.start()
        for spec in self.specs:
            p = engine_proc(spec)
            p.start(log_dir=self.workdir)
            self.engines.append(p)
        for p in self.engines:
            wait_http(p.url + "/health", timeout_s=30, proc=p.popen)
        cfg = gateway_config(
            list(zip(self.specs, [p.url for p in self.engines], strict=True)),
            **fault_config(**self.overrides),
        )
        cfg["store"]["redis_url"] = self.redis.url
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.start_gateway()
        self.wait_ready(self.gateways[0].url)
        return self

    def start_gateway(self, reservation_ttl_s: float | None = None) -> Proc:
        """One more gateway replica; ``reservation_ttl_s`` overrides the suite's TTL for it alone."""
        port = free_port()
        config_path = self.config_path
        if reservation_ttl_s is not None:
            cfg = yaml.safe_load(self.config_path.read_text())
            cfg["store"]["reservation_ttl_s"] = reservation_ttl_s
            config_path = self.workdir / f"kvroute-{len(self.gateways)}.yaml"
            config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        argv = [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--config",
            str(config_path),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        g = Proc(f"gateway-{len(self.gateways)}", argv, f"http://127.0.0.1:{port}")
        g.start(env=env, log_dir=self.workdir)
        self.gateways.append(g)
        wait_http(g.url + "/health", timeout_s=40, proc=g.popen)
        return g

    @property
    def url(self) -> str:
        return self.gateways[0].url

    def engine_url(self, i: int) -> str:
        return self.engines[i].url

    def kill_engine(self, i: int) -> None:
        self.engines[i].signal(signal.SIGKILL)
        assert self.engines[i].popen is not None
        self.engines[i].popen.wait(10)

    def restart_engine(self, i: int) -> None:
        p = self.engines[i]
        if p.alive:
            return
        p.popen = None
        p.start(log_dir=self.workdir)  # same argv: same port
        wait_http(p.url + "/health", timeout_s=30, proc=p.popen)

    def fault(self, i: int, mode: str) -> None:
        httpx.post(
            self.engines[i].url + "/admin/fault", json={"mode": mode}, timeout=5
        ).raise_for_status()

    def kill_redis(self) -> None:
        assert self.redis.proc is not None
        self.redis.proc.kill()
        self.redis.proc.wait(5)
        self.redis.proc = None

    def restart_redis(self) -> None:
        """Start again on the same port: an empty server, as after a crash without persistence."""
        deadline = time.monotonic() + 20
        while not self.redis._launch(deadline):
            time.sleep(0.1)

    def stop(self) -> None:
        for g in self.gateways:
            g.stop()
        for p in self.engines:
            p.stop()
        self.redis.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------- state checks
    def fleet_state(self, url: str | None = None) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get((url or self.url) + "/fleet", timeout=5).json()
        return data

    def wait_ready(self, url: str, timeout_s: float = 30) -> None:
        """Every backend reported, healthy by the active checks, not ejected."""

        seen: list[str] = [""]

        def ready() -> bool:
            st = self.fleet_state(url)
            healthy = metric_values(url, "kvroute_backend_healthy")
            ejected = metric_values(url, "kvroute_backend_ejected")
            nodes = [(b["name"], b["up"], bool(b["report"])) for b in st["backends"]]
            seen[0] = f"degraded={st['degraded']} nodes={nodes} healthy={healthy} ejected={ejected}"
            if st["degraded"] or not all(up and rep for _, up, rep in nodes):
                return False
            return all(v == 1.0 for v in healthy.values()) and not any(ejected.values())

        try:
            wait_for(ready, timeout_s, f"gateway {url} to see every backend healthy")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {seen[0]}") from None

    def live_reservations(self) -> dict[str, int]:
        """Unexpired reservations in Redis, per backend (what a leak would leave)."""
        r = redis.Redis.from_url(self.redis.url, socket_timeout=2)
        try:
            now = time.time()
            out: dict[str, int] = {}
            for key in r.scan_iter(match=f"{self.prefix}:backend:*:res"):
                name = key.decode().split(":")[2]
                live = 0
                for v in r.hvals(key):
                    parts = v.decode().split(" ")
                    if len(parts) == 3 and float(parts[2]) > now:
                        live += 1
                if live:
                    out[name] = live
            return out
        finally:
            r.close()

    def ledger(self, url: str) -> dict[str, int]:
        """What one gateway replica still holds: reservations and queued releases (/fleet)."""
        held: dict[str, int] = self.fleet_state(url)["reservations"]
        return held

    def assert_no_reservations(self, timeout_s: float = LEAK_CHECK_S) -> None:
        """Nothing left reserved: in every live gateway's own ledger, in Redis, in /fleet.

        The wait (``timeout_s``) covers background releases landing; it is far below the
        suite's reservation TTL, so a reservation nobody releases cannot expire meanwhile.
        """
        assert timeout_s * 10 <= RESERVATION_TTL_S, "a leak check must not outwait the TTL"
        seen: dict[str, object] = {}
        for g in self.gateways:
            if g.alive:

                def empty(g: Proc = g) -> bool:
                    seen[g.name] = self.ledger(g.url)
                    return seen[g.name] == {"held": 0, "pending_releases": 0}

                try:
                    wait_for(empty, timeout_s, f"{g.name}'s ledger to be empty")
                except AssertionError as exc:
                    raise AssertionError(f"{exc}; last seen: {seen[g.name]}") from None

        def redis_empty() -> bool:
            seen["redis"] = self.live_reservations()
            return not seen["redis"]

        try:
            wait_for(redis_empty, timeout_s, "every reservation in Redis to be released")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; left: {seen['redis']}") from None
        for g in self.gateways:
            if g.alive:
                wait_for(
                    lambda g=g: all(
                        b["overlay"]["inflight"] == 0 for b in self.fleet_state(g.url)["backends"]
                    ),
                    timeout_s,
                    f"{g.name} to show no request in flight",
                )

    def heal(self) -> None:
        """Undo every fault, then wait until the gateway sees the whole fleet healthy again."""
        if self.redis.paused:
            self.redis.resume()
        if self.redis.proc is None:
            self.restart_redis()
        for i, p in enumerate(self.engines):
            if not p.alive:
                self.restart_engine(i)
            else:
                self.fault(i, "none")
        for g in self.gateways:
            if g.alive:
                self.wait_ready(g.url)


async def recovered(url: str, n: int = 12) -> Tally:
    """After the fault: a round of requests that must all succeed, without restarting anything."""
    tally = Tally()
    async with new_client() as client:
        for i in range(n):
            bucket, detail, backend = await send(client, url, body(stream=i % 2 == 0))
            tally.add(bucket, detail, backend)
    return tally


def log_tail(fleet: FaultFleet, name: str, n: int = 3000) -> str:
    p = fleet.workdir / f"{name}.log"
    return p.read_text(errors="replace")[-n:] if p.exists() else ""


def record(results: dict[str, dict[str, Any]], name: str, tally: Tally, **extra: Any) -> None:
    """Keep each scenario's counts; printed at the end of the module (pytest -s) and in docs."""
    results[name] = {
        "sent": tally.sent,
        "ok": tally.ok,
        "failed": tally.failed,
        "lost": tally.lost,
        **extra,
    }


__all__: Sequence[str] = [
    "FaultFleet",
    "Tally",
    "after",
    "body",
    "counter_total",
    "fault_config",
    "metric_values",
    "recovered",
    "run_load",
    "send",
    "wait_for",
]
