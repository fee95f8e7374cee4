"""Locust load test: OpenAI-style users against the kvroute gateway.

Request sizes follow the problem statement's bimodal mix (70% short chat under 500 prompt
tokens, 30% long documents of 15k-30k) or a trace's length distribution (``--kv-trace``,
Azure CSV or JSONL, with ``--kv-length-scale``). Three users:

- ``ChatUser``: non-streaming chat (and a share of ``/v1/completions``);
- ``StreamingChatUser``: ``stream: true``, reads the SSE stream to the end and records
  time to first event and the stream's whole duration;
- ``RetryingChatUser``: on a retryable failure (502/503/504/429) it waits (honouring
  ``Retry-After``, capped) and sends the same request again with the same
  ``Idempotency-Key``, as a well-behaved client would; it records whether the retry
  succeeded and whether the gateway ever sent it back to a backend that had failed it.

Besides Locust's own rows, custom rows of type ``KVROUTE`` (in the CSV, the HTML report and
the Aggregated line) record what the gateway said: ``failure <cause>`` (``error.cause``,
else ``error.code``, from the error body), ``diverted: N attempts`` (``x-kvroute-attempts``
above 1), ``retry ...`` outcomes, and ``stream first event`` / ``stream total`` for
streams. ``--kv-summary FILE`` writes all counters as JSON when the run ends, plus the
per-response ``attempts N`` and ``class short|long`` counts (``x-kvroute-class``).

Needs locust: ``pip install 'kvroute[loadtest]'``. Locust exits 1 when any request failed
(its ``--exit-code-on-error``, default 1), so a run with a single 503 "fails".

Headless against a running gateway, CSV and HTML report::

    locust -f loadtest/bench/locustfile.py --headless -u 50 -r 10 -t 60s \\
        --host http://127.0.0.1:8000 --csv out/kv --html out/kv.html

Or let this module start a local fleet (4 simulated engines, 2 in a long pool, the gateway;
``--redis`` adds a redis-server) and run exactly that against it::

    python -m loadtest.bench.locustfile --speedup 20 -- --headless -u 50 -r 10 -t 60s --csv out/kv --html out/kv.html
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.workload import chat_overhead_tokens, load_trace, make_prompt

LOCUST_HINT = (
    "locust is not installed: pip install 'kvroute[loadtest]' "
    "(in a clone: pip install -e '.[loadtest]')"
)
try:
    import gevent
    from locust import HttpUser, events, task
    from locust.env import Environment
    from locust.stats import CSV_STATS_INTERVAL_SEC
except ModuleNotFoundError as exc:  # pragma: no cover - exercised in a subprocess test
    if not (exc.name or "").startswith("locust"):
        raise
    raise SystemExit(LOCUST_HINT) from None

RETRYABLE = frozenset({429, 502, 503, 504})
KV = "KVROUTE"


# ------------------------------------------------------------------ options


@events.init_command_line_parser.add_listener
def _add_options(parser: Any) -> None:
    g = parser.add_argument_group("kvroute workload")
    g.add_argument(
        "--kv-mix",
        choices=["bimodal", "trace"],
        default="bimodal",
        env_var="KV_MIX",
        help="request sizes: bimodal or a trace's",
    )
    g.add_argument(
        "--kv-trace",
        default="",
        env_var="KV_TRACE",
        help="trace file (Azure CSV or JSONL) for --kv-mix trace",
    )
    g.add_argument(
        "--kv-length-scale",
        type=float,
        default=1.0,
        env_var="KV_LENGTH_SCALE",
        help="multiply trace prompt lengths",
    )
    g.add_argument(
        "--kv-short-share",
        type=float,
        default=0.7,
        env_var="KV_SHORT_SHARE",
        help="bimodal: share of short requests",
    )
    g.add_argument(
        "--kv-short-tokens",
        default="20-500",
        env_var="KV_SHORT_TOKENS",
        help="bimodal: short prompt range LOW-HIGH",
    )
    g.add_argument(
        "--kv-long-tokens",
        default="15000-30000",
        env_var="KV_LONG_TOKENS",
        help="bimodal: long prompt range LOW-HIGH",
    )
    g.add_argument(
        "--kv-short-output",
        default="16-256",
        env_var="KV_SHORT_OUTPUT",
        help="bimodal: short max_tokens range",
    )
    g.add_argument(
        "--kv-long-output",
        default="128-1024",
        env_var="KV_LONG_OUTPUT",
        help="bimodal: long max_tokens range",
    )
    g.add_argument(
        "--kv-completions-share",
        type=float,
        default=0.2,
        env_var="KV_COMPLETIONS_SHARE",
        help="ChatUser: share sent to /v1/completions",
    )
    g.add_argument("--kv-model", default="sim-model", env_var="KV_MODEL")
    g.add_argument(
        "--kv-think-s",
        type=float,
        default=0.5,
        env_var="KV_THINK_S",
        help="each user waits uniform(0, this) between requests",
    )
    g.add_argument(
        "--kv-max-retries",
        type=int,
        default=3,
        env_var="KV_MAX_RETRIES",
        help="RetryingChatUser: retries after the first try",
    )
    g.add_argument(
        "--kv-retry-wait-cap-s",
        type=float,
        default=1.0,
        env_var="KV_RETRY_WAIT_CAP_S",
        help="cap on a Retry-After wait",
    )
    g.add_argument("--kv-seed", type=int, default=0, env_var="KV_SEED")
    g.add_argument(
        "--kv-stop-after",
        type=int,
        default=0,
        env_var="KV_STOP_AFTER",
        help="end the run once this many requests have finished (0: run for -t); "
        "a run of a fixed size, however fast the machine",
    )
    g.add_argument(
        "--kv-summary",
        default="",
        env_var="KV_SUMMARY",
        help="write the KVROUTE counters as JSON here at the end",
    )


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"bad range {text!r}: need LOW-HIGH with 1 <= LOW <= HIGH")
    return a, b


class Sizes:
    """Draws (kind, prompt tokens, max_tokens) from the configured distribution."""

    def __init__(self, opts: Any) -> None:
        self.opts = opts
        self.trace: list[tuple[str, int, int]] = []
        if opts.kv_mix == "trace":
            if not opts.kv_trace:
                raise ValueError("--kv-mix trace needs --kv-trace FILE")
            self.trace = [
                (r.kind, r.prompt_tokens, r.output_tokens)
                for r in load_trace(opts.kv_trace, opts.kv_length_scale)
            ]
            if not self.trace:
                raise ValueError(f"{opts.kv_trace}: no requests")
        self.short, self.long = _range(opts.kv_short_tokens), _range(opts.kv_long_tokens)
        self.short_out, self.long_out = _range(opts.kv_short_output), _range(opts.kv_long_output)

    def draw(self, rng: random.Random) -> tuple[str, int, int]:
        if self.trace:
            return rng.choice(self.trace)
        if rng.random() < self.opts.kv_short_share:
            return "short", rng.randint(*self.short), rng.randint(*self.short_out)
        return "long", rng.randint(*self.long), rng.randint(*self.long_out)


# ------------------------------------------------------------------ custom stats


class KvStats:
    """The KVROUTE counters; Locust's stats get one row per name as well."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.finished = 0  # HTTP requests finished, for --kv-stop-after

    def count(self, name: str) -> None:
        """Summary counter only (no Locust row)."""
        with self.lock:
            self.counts[name] += 1

    def record(
        self, env: Environment, name: str, response_time_ms: float = 0.0, length: int = 0
    ) -> None:
        """Summary counter and a KVROUTE row in Locust's stats."""
        self.count(name)
        env.events.request.fire(
            request_type=KV,
            name=name,
            response_time=response_time_ms,
            response_length=length,
            exception=None,
            context={},
        )

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()
            self.finished = 0


KV_STATS = KvStats()
_SIZES: dict[int, Sizes] = {}
_RUN: dict[int, Environment] = {}  # the running environment, for --kv-stop-after


@events.test_start.add_listener
def _on_start(environment: Environment, **_: Any) -> None:
    KV_STATS.reset()
    _RUN[0] = environment
    if environment.parsed_options is not None:
        _SIZES[0] = Sizes(environment.parsed_options)


@events.request.add_listener
def _on_request(request_type: str, **_: Any) -> None:
    """Count finished HTTP requests (not the KVROUTE rows); quit at ``--kv-stop-after``."""
    env = _RUN.get(0)
    if request_type == KV or env is None:
        return
    limit = getattr(getattr(env, "parsed_options", None), "kv_stop_after", 0)
    if not limit:
        return
    with KV_STATS.lock:
        KV_STATS.finished += 1
        reached = KV_STATS.finished == limit
    if reached and env.runner is not None:
        # Not from inside the event: stopping kills the greenlet that fired it.
        gevent.spawn(_stop_then_quit, env.runner)


def _stop_then_quit(runner: Any) -> None:
    """Stop the users, let Locust's CSV writer write the final rows, then quit.

    Locust writes ``--csv`` files from a greenlet every ``CSV_STATS_INTERVAL_SEC`` and only
    closes them at exit: quitting at once left the files as they were up to a second before,
    so a short run (120 requests in under a second) wrote a stats file with no requests.
    """
    runner.stop()
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)
    runner.quit()


@events.quitting.add_listener
def _on_quit(environment: Environment, **_: Any) -> None:
    opts = environment.parsed_options
    counts = dict(sorted(KV_STATS.counts.items()))
    if counts:
        print("kvroute counters: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    if opts is not None and opts.kv_summary:
        Path(opts.kv_summary).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.kv_summary).write_text(
            json.dumps(
                {"counts": counts, "total_requests": environment.stats.total.num_requests}, indent=2
            )
        )


def error_cause(body: bytes | str | None) -> str:
    """error.cause, else error.code, else error.type of an OpenAI-style error body ('-' if none)."""
    try:
        err = json.loads(body or b"").get("error", {})
    except (ValueError, AttributeError):
        return "not_json"
    if not isinstance(err, dict):
        return "-"
    return str(err.get("cause") or err.get("code") or err.get("type") or "-")


# ------------------------------------------------------------------ users


class _KvUser(HttpUser):
    abstract = True

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.sizes = _SIZES.get(0) or Sizes(opts)
        self.rng = random.Random(f"{opts.kv_seed}-{id(self)}")

    def wait_time(self) -> float:
        return self.rng.uniform(0.0, max(0.0, self.opts.kv_think_s))

    def body(self, stream: bool, completions: bool = False) -> tuple[str, str, dict[str, Any]]:
        kind, prompt, out = self.sizes.draw(self.rng)
        if completions:
            text = make_prompt(prompt, self.rng)
            return (
                kind,
                "/v1/completions",
                {"model": self.opts.kv_model, "prompt": text, "max_tokens": out, "stream": stream},
            )
        text = make_prompt(max(1, prompt - chat_overhead_tokens()), self.rng)
        msgs = [{"role": "user", "content": text}]
        return (
            kind,
            "/v1/chat/completions",
            {"model": self.opts.kv_model, "messages": msgs, "max_tokens": out, "stream": stream},
        )

    def note_headers(self, resp: Any, elapsed_ms: float) -> None:
        """Class and attempts go to the summary counters; a diverted request also gets a Locust row."""
        h = resp.headers
        if h.get("x-kvroute-class"):
            KV_STATS.count(f"class {h['x-kvroute-class']}")
        attempts = h.get("x-kvroute-attempts")
        if attempts:
            KV_STATS.count(f"attempts {attempts}")
            if attempts.isdigit() and int(attempts) > 1:
                KV_STATS.record(self.environment, f"diverted: {attempts} attempts", elapsed_ms)

    def post(
        self, path: str, body: dict[str, Any], name: str, headers: dict[str, str] | None = None
    ) -> tuple[int, str, str, dict[str, str]]:
        """One non-streaming request; returns (status, cause, backend, headers)."""
        t0 = time.perf_counter()
        with self.client.post(
            path, json=body, name=name, headers=headers, catch_response=True
        ) as resp:
            ms = (time.perf_counter() - t0) * 1000
            self.note_headers(resp, ms)
            cause = ""
            if resp.status_code != 200:
                cause = error_cause(resp.content) if resp.status_code else "connection_error"
                KV_STATS.record(self.environment, f"failure {cause}", ms)
                resp.failure(f"HTTP {resp.status_code} {cause}")
            return (
                resp.status_code,
                cause,
                resp.headers.get("x-kvroute-backend", ""),
                dict(resp.headers),
            )


class ChatUser(_KvUser):
    """Non-streaming chat; a share of requests go to /v1/completions."""

    weight = 3

    @task
    def chat(self) -> None:
        completions = self.rng.random() < self.opts.kv_completions_share
        kind, path, body = self.body(stream=False, completions=completions)
        self.post(path, body, name=f"{path} {kind}")


class StreamingChatUser(_KvUser):
    """stream: true; the stream is read to the end, an SSE error event counts as a failure."""

    weight = 1

    @task
    def stream(self) -> None:
        kind, path, body = self.body(stream=True)
        t0 = time.perf_counter()
        with self.client.post(
            path, json=body, name=f"{path} stream {kind}", stream=True, catch_response=True
        ) as resp:
            self.note_headers(resp, (time.perf_counter() - t0) * 1000)
            if resp.status_code != 200:
                cause = error_cause(resp.content) if resp.status_code else "connection_error"
                KV_STATS.record(
                    self.environment, f"failure {cause}", (time.perf_counter() - t0) * 1000
                )
                resp.failure(f"HTTP {resp.status_code} {cause}")
                return
            events_seen = 0
            first_ms: float | None = None
            broken = ""
            for line in resp.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                if first_ms is None:
                    first_ms = (time.perf_counter() - t0) * 1000
                events_seen += 1
                payload = line[5:].strip()
                if payload.startswith(b"{") and b'"error"' in payload:
                    broken = error_cause(payload)
            total_ms = (time.perf_counter() - t0) * 1000
            if first_ms is not None:
                KV_STATS.record(self.environment, "stream first event", first_ms)
            KV_STATS.record(self.environment, "stream total", total_ms, events_seen)
            if broken:
                KV_STATS.record(self.environment, f"failure {broken}", total_ms)
                resp.failure(f"stream broke off: {broken}")
            elif events_seen == 0:
                resp.failure("empty stream")


class RetryingChatUser(_KvUser):
    """Retries a failed request with the same Idempotency-Key, as a well-behaved client does."""

    weight = 1

    @task
    def chat_with_retry(self) -> None:
        kind, path, body = self.body(stream=False)
        key = uuid.uuid4().hex
        failed_on: set[str] = set()
        t0 = time.perf_counter()
        for attempt in range(self.opts.kv_max_retries + 1):
            name = f"{path} {kind}" if attempt == 0 else f"{path} {kind} retry"
            status, _cause, backend, headers = self.post(
                path, body, name, headers={"Idempotency-Key": key}
            )
            if attempt > 0 and backend and backend in failed_on:
                KV_STATS.record(self.environment, "retry sent back to a node that failed it")
            if status == 200:
                if attempt > 0:
                    KV_STATS.record(
                        self.environment,
                        f"retry ok after {attempt}",
                        (time.perf_counter() - t0) * 1000,
                    )
                return
            if status not in RETRYABLE:
                return
            if backend and backend != "none":
                failed_on.add(backend)
            if attempt < self.opts.kv_max_retries:
                try:
                    wait = float(headers.get("retry-after", headers.get("Retry-After", "0.1")))
                except ValueError:
                    wait = 0.1
                time.sleep(min(max(0.0, wait), self.opts.kv_retry_wait_cap_s))
        KV_STATS.record(self.environment, "retry gave up", (time.perf_counter() - t0) * 1000)


# ------------------------------------------------------------------ local fleet helper

# The fleet runs in a child process of its own: importing locust monkey-patches this one
# with gevent, under which httpx (used by LocalFleet) cannot import. The child stops the
# fleet when its stdin closes, so it never outlives this process.
_FLEET_CHILD = """
import json, sys
from loadtest.local_fleet import EngineSpec, LocalFleet
a = json.loads(sys.argv[1])
specs = [EngineSpec(f"long-{i}", "long", capacity_tokens=a["capacity"], speedup=a["speedup"]) for i in range(a["long"])]
specs += [EngineSpec(f"general-{i}", "general", capacity_tokens=a["capacity"], speedup=a["speedup"]) for i in range(a["general"])]
fleet = LocalFleet(specs, policy=a["policy"], use_redis=a["redis"])
try:
    fleet.start()
    print(fleet.gateway_url, flush=True)
    sys.stdin.read()
finally:
    fleet.stop()
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Start a local fleet, run locust against its gateway with the arguments after '--', stop it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    locust_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, locust_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench.locustfile",
        description="run this locustfile against a local fleet",
    )
    p.add_argument("--long-engines", type=int, default=2)
    p.add_argument("--general-engines", type=int, default=2)
    p.add_argument("--capacity-tokens", type=int, default=100_000)
    p.add_argument("--speedup", type=float, default=10.0)
    p.add_argument("--policy", default="kvroute")
    p.add_argument(
        "--redis", action="store_true", help="start a redis-server and use the Redis store"
    )
    args = p.parse_args(argv)
    spec = {
        "long": args.long_engines,
        "general": args.general_engines,
        "capacity": args.capacity_tokens,
        "speedup": args.speedup,
        "policy": args.policy,
        "redis": args.redis,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", _FLEET_CHILD, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        url = child.stdout.readline().decode().strip()
        if not url.startswith("http"):
            print(f"the local fleet did not start (exit {child.wait(30)})", file=sys.stderr)
            return 1
        print(f"local fleet up: gateway {url}", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(Path(__file__).resolve()),
            "--host",
            url,
            *locust_args,
        ]
        rc = subprocess.run(cmd, check=False).returncode
        if rc == 1:
            # Locust's own rule: exit 1 when any request failed, even one in thousands.
            print(
                "locust exited 1 because at least one request failed (its default "
                "--exit-code-on-error); the failures table and the KVROUTE rows say which and why",
                file=sys.stderr,
            )
        return rc
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()


if __name__ == "__main__":
    sys.exit(main())
