"""Start a local fleet as real processes: simulated engines, optional Redis, the gateway.

Used by the demo, the end-to-end comparison, benchmarks and the fault-injection tests,
so every one of them exercises the same processes a user would run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtest.children import die_with_parent_hook, log_tail, port_in_use
from loadtest.free_ports import free_ports
from loadtest.llama_fleet import HTTP_THREADS, MODEL_ALIAS, find_llama


def free_port() -> int:
    """Below the ephemeral range: no outgoing connection takes it before the child binds."""
    return free_ports(1)


def wait_http(
    url: str, timeout_s: float = 20.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll `url` until it answers 2xx; fail early if the process died."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code < 300:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = exc.__class__.__name__
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout_s}s ({last})")


@dataclass
class Proc:
    name: str
    argv: list[str]
    url: str
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self, env: dict[str, str] | None = None, log_dir: Path | None = None) -> None:
        out: Any = subprocess.DEVNULL
        if log_dir is not None:
            self.log_path = log_dir / f"{self.name}.log"
            out = self.log_path.open("ab")
        # Own session: a terminal's Ctrl-C reaches only the parent, which stops children in
        # order; the parent-death signal covers a parent that dies without stopping them.
        self.popen = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent_hook(),
        )

    def wait_ready(self, path: str = "/health", timeout_s: float = 20.0) -> None:
        """Wait until ``url + path`` answers; a failure says why, from the child's own log."""
        try:
            wait_http(self.url + path, timeout_s=timeout_s, proc=self.popen)
        except (RuntimeError, TimeoutError) as exc:
            tail = log_tail(self.log_path)
            raise RuntimeError(
                f"{self.name}: {exc}" + (f"; its log ends:\n{tail}" if tail else "")
            ) from exc

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        self.popen = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class EngineSpec:
    name: str
    pool: str = "general"
    allocator: str = "contiguous"
    capacity_tokens: int = 100_000
    speedup: float = 50.0
    block_size: int = 16
    extra: Sequence[str] = ()


def engine_proc(spec: EngineSpec, port: int | None = None) -> Proc:
    port = port or free_port()
    argv = [
        sys.executable, "-m", "loadtest.engine.server",
        "--host", "127.0.0.1", "--port", str(port), "--name", spec.name,
        "--allocator", spec.allocator, "--capacity-tokens", str(spec.capacity_tokens),
        "--speedup", str(spec.speedup), "--block-size", str(spec.block_size), *spec.extra,
    ]  # fmt: skip
    return Proc(spec.name, argv, f"http://127.0.0.1:{port}")


def redis_proc(workdir: Path, port: int | None = None) -> Proc:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = port or free_port()
    argv = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
    ]
    return Proc("redis", argv, f"redis://127.0.0.1:{port}/0")


def gateway_config(engines: Sequence[tuple[EngineSpec, str]], **overrides: Any) -> dict[str, Any]:
    pools = sorted({spec.pool for spec, _ in engines} | {"general"})
    cfg: dict[str, Any] = {
        "pools": {p: {"role": "long" if p == "long" else "general"} for p in pools},
        "backends": [
            {"name": s.name, "url": url, "pool": s.pool, "kind": s.allocator} for s, url in engines
        ],
        "collector": {"scrape_interval_s": 0.25, "stale_after_s": 3.0},
    }
    for section, values in overrides.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


@dataclass
class LocalFleet:
    """Engines + (optional) Redis + gateway processes; use as a context manager."""

    specs: Sequence[EngineSpec]
    policy: str = "kvroute"
    use_redis: bool = False
    config_overrides: dict[str, Any] = field(default_factory=dict)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvroute-fleet-")))
    # Delete ``workdir`` (configs and logs) in ``stop()``; False keeps a caller's own folder.
    remove_workdir: bool = True
    engines: list[Proc] = field(default_factory=list)
    redis: Proc | None = None
    gateway: Proc | None = None
    gateway_port: int = 0

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start_engines(self) -> None:
        for spec in self.specs:
            p = engine_proc(spec)
            p.start(log_dir=self.workdir)
            self.engines.append(p)
        for p in self.engines:
            p.wait_ready()

    def start_redis(self) -> None:
        self.redis = redis_proc(self.workdir)
        self.redis.start(log_dir=self.workdir)
        import redis as redis_lib

        deadline = time.monotonic() + 10
        while True:
            try:
                redis_lib.Redis.from_url(self.redis.url).ping()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def write_config(self, policy: str | None = None) -> Path:
        overrides = {
            k: dict(v) if isinstance(v, dict) else v for k, v in self.config_overrides.items()
        }
        overrides.setdefault("routing", {})["policy"] = policy or self.policy
        if self.redis is not None:
            overrides.setdefault("store", {})["redis_url"] = self.redis.url
        cfg = gateway_config(
            list(zip(self.specs, [p.url for p in self.engines], strict=True)), **overrides
        )
        path = self.workdir / f"kvroute-{policy or self.policy}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def start_gateway(self, policy: str | None = None, port: int | None = None) -> Proc:
        path = self.write_config(policy)
        self.gateway_port = port or free_port()
        argv = [
            sys.executable,
            "-m",
            "proxy.cli",
            "serve",
            "--config",
            str(path),
            "--port",
            str(self.gateway_port),
            "--log-level",
            "warning",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
        self.gateway = Proc("gateway", argv, self.gateway_url)
        self.gateway.start(env=env, log_dir=self.workdir)
        self.gateway.wait_ready()
        return self.gateway

    def stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None

    def restart_engines(self) -> None:
        """What a process restart does: every allocator empty, uptime reset."""
        for p in self.engines:
            httpx.post(p.url + "/admin/restart", timeout=5).raise_for_status()

    def start(self) -> LocalFleet:
        if self.use_redis:
            self.start_redis()
        self.start_engines()
        self.start_gateway()
        return self

    def stop(self) -> None:
        self.stop_gateway()
        for p in self.engines:
            p.stop()
        self.engines.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.remove_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalFleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def local_fleet(specs: Sequence[EngineSpec], **kw: Any) -> Iterator[LocalFleet]:
    fleet = LocalFleet(specs, **kw)
    with fleet:
        yield fleet


# --- `kvroute local-fleet`: the engines a config file expects -------------------------------

LOCAL_HOSTS = ("127.0.0.1", "localhost")


def specs_from_config(
    path: str, speedup: float, capacity_tokens: int
) -> list[tuple[EngineSpec, int]]:
    """One simulated engine per backend of a config, on the backend's own port and allocator."""
    from urllib.parse import urlsplit

    from proxy.config import load_config

    cfg = load_config(path)
    out: list[tuple[EngineSpec, int]] = []
    for b in cfg.backends:
        parts = urlsplit(b.base_url)
        if parts.hostname not in LOCAL_HOSTS or parts.port is None:
            raise ValueError(f"backend {b.name}: {b.base_url} is not a 127.0.0.1:PORT address")
        if b.kind == "llamacpp":
            out.append((llama_spec(b.name, b.pool, b.kv_layout, b.capacity_tokens), parts.port))
            continue
        if b.kind not in ("contiguous", "paged"):
            raise ValueError(
                f"backend {b.name}: kind {b.kind!r}; the simulated engine serves kind "
                "'contiguous' or 'paged' (kvroute's gauges), a real llama-server kind 'llamacpp'"
            )
        cap = b.capacity_tokens or capacity_tokens
        spec = EngineSpec(b.name, b.pool, b.kind, capacity_tokens=cap, speedup=speedup)
        out.append((spec, parts.port))
    return out


#: A real llama-server's context where the config gives no capacity_tokens, and its slots.
LLAMA_CONTEXT, LLAMA_SLOTS = 4096, 4


def llama_spec(name: str, pool: str, layout: str, capacity_tokens: int | None) -> EngineSpec:
    """A ``kind: llamacpp`` backend: a real llama-server with the config's slot layout."""
    cap = capacity_tokens or LLAMA_CONTEXT
    flags = ["-c", str(cap), "-np", str(LLAMA_SLOTS)]
    if layout == "unified":
        flags.append("--kv-unified")
    return EngineSpec(name, pool, "llamacpp", capacity_tokens=cap, extra=tuple(flags))


def llama_proc(spec: EngineSpec, port: int, binary: str, model: Path) -> Proc:
    """llama-server (``loadtest.llama_fleet``'s model and settings) on ``port``."""
    argv = [binary, "-m", str(model), "--alias", MODEL_ALIAS, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", "1", "-tb", "1", "-b", "512", "-ub", "512"]
    argv += ["--metrics", "--threads-http", str(HTTP_THREADS), "--no-webui", *spec.extra]
    return Proc(spec.name, argv, f"http://127.0.0.1:{port}")


def fleet_procs(wanted: Sequence[tuple[EngineSpec, int]]) -> list[Proc] | str:
    """One process per backend; for llama.cpp backends, or what to install when it is missing."""
    llama: tuple[str, Path] | str | None = None
    procs = []
    for spec, port in wanted:
        if spec.allocator != "llamacpp":
            procs.append(engine_proc(spec, port))
            continue
        llama = find_llama() if llama is None else llama
        if isinstance(llama, str):
            return f"backend {spec.name} is kind llamacpp, but {llama}"
        procs.append(llama_proc(spec, port, *llama))
    return procs


def busy_ports(wanted: Sequence[tuple[EngineSpec, int]]) -> list[str]:
    """Backends whose port already answers: a new engine there would exit at once.

    Checked before starting, because an engine left from an earlier run also answers
    ``/health``: waiting for health alone would report "ready" for the old process.
    """
    return [f"{spec.name} (port {port})" for spec, port in wanted if port_in_use(port)]


def exit_causes(procs: Sequence[Proc]) -> str:
    """For each engine that exited: its exit status and the end of its log (the real cause)."""
    out = []
    for proc in procs:
        if proc.popen is None or proc.alive:
            continue
        tail = log_tail(proc.log_path)
        out.append(
            f"engine {proc.name} exited with {proc.popen.returncode}"
            + (f":\n{tail}" if tail else "")
        )
    return "\n".join(out)


def _parse_args(argv: Sequence[str] | None) -> Any:
    import argparse

    p = argparse.ArgumentParser(
        prog="kvroute local-fleet",
        description="Start one simulated engine per backend of a config file (on the backend's "
        "port, with its kind as the allocator; a real llama-server for kind llamacpp, with its "
        "kv_layout), so `kvroute serve --config FILE` has every backend it expects. Runs until "
        "Ctrl-C, SIGTERM or a hangup (closing the terminal); the engines never outlive it.",
    )
    p.add_argument("--config", default="config/kvroute.yaml")
    p.add_argument(
        "--speedup",
        type=float,
        default=10.0,
        help="engine time acceleration (default 10: a 30k-token document takes seconds, not minutes)",
    )
    p.add_argument("--capacity-tokens", type=int, default=100_000)
    return p.parse_args(argv)


def _run_engines(
    procs: Sequence[Proc], wanted: Sequence[tuple[EngineSpec, int]], config: str, logs: Path
) -> int:
    """Start, announce, then watch until a stop signal (0) or an engine exits (1, with why)."""
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    # A hangup (the terminal closed) stops the fleet like Ctrl-C: nobody is left to use it.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    for proc in procs:
        proc.start(log_dir=logs)
    for proc in procs:
        proc.wait_ready()
    for (spec, _), proc in zip(wanted, procs, strict=True):
        what = (
            f"llama-server {' '.join(spec.extra)}"
            if spec.allocator == "llamacpp"
            else f"{spec.capacity_tokens:,} tokens, speedup {spec.speedup:g}"
        )
        print(
            f"engine {spec.name}: {proc.url} ({spec.allocator}, pool {spec.pool}, {what})",
            flush=True,
        )
    print(f"ready: now run `kvroute serve --config {config}`; Ctrl-C stops the engines", flush=True)
    while not stop["now"] and all(proc.alive for proc in procs):
        time.sleep(0.2)
    if stop["now"]:
        return 0
    print(exit_causes(procs), file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Start the engines a config expects and keep them running until stopped."""
    args = _parse_args(argv)
    try:
        wanted = specs_from_config(args.config, args.speedup, args.capacity_tokens)
    except Exception as exc:  # ConfigError or a backend it cannot simulate
        print(f"kvroute local-fleet: {exc}", file=sys.stderr)
        return 2
    if busy := busy_ports(wanted):
        print(
            f"kvroute local-fleet: port in use for {', '.join(busy)}: another process listens "
            "there (an earlier local-fleet? `ss -ltnp` shows which)",
            file=sys.stderr,
        )
        return 1
    procs = fleet_procs(wanted)
    if isinstance(procs, str):
        print(f"kvroute local-fleet: {procs}", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="kvroute-local-fleet-"))
    try:
        return _run_engines(procs, wanted, args.config, logs)
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvroute local-fleet: {exc}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            proc.stop()
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
