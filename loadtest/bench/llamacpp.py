"""Real llama.cpp servers with mixed slot layouts, by router.

Three ``llama-server`` processes with the same 4,096 cells each, laid out three ways:
``a`` one unified pool with 4 slots (``-c 4096 -np 4 --kv-unified``), ``b``
four partitioned slots of 1,024 (``-c 4096 -np 4``), ``c`` two slots of 2,048
(``-c 4096 -np 2``); SmolLM2-135M, one thread each (``loadtest.llama_fleet``). Fresh
servers for every router.

The load: an open-loop list of streamed chats (``--requests`` at ``--rate`` per second),
70% chats of 60-150 prompt tokens and 30% documents of 700-1,800 (sized around the slots),
``max_tokens`` 64, the same list for every router. The routers:

* ``kvroute``: the gateway (``kvroute serve``), each backend ``kind: llamacpp`` with its
  ``kv_layout``, prompts counted with the model's own vocabulary (its ``.gguf``), a request
  held at most 300 s and waiting at most as long for its first token in a server's queue;
* ``round_robin``: the client cycles over the servers;
* ``idle_slots``: the server with the most idle slots in ``/slots`` at send time, as paddler
  balances (its most favourable reading: fresh at every request);
* ``vllm-router:round_robin``, ``vllm-router:cache_aware``: vllm-router with the three
  servers as workers (found on PATH or in /tmp/vllm-router-venv; skipped without it).

It reports failed requests (an error status, or a stream cut by an error event), TTFT p50 /
p99 of the requests that succeeded (all, and documents alone), and goodput: requests that
succeeded per second of the run, their output tokens per second, and the prompt words
(tokens, by construction) they carried per second: a router that fails the longest documents
at once has that much less prefill to do. The default rate, 0.6 per second, is a load three
one-thread servers carry on two cores with every document served; at 1.2 they cannot, and
the routers that fail documents have less to do (docs/benchmarks.md section 13).

    python -m loadtest.bench llamacpp --requests 60 --rate 0.6 --json out/llamacpp.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.engine_fleet import start_gateway, start_vllm_router
from loadtest.bench.overhead_targets import find_vllm_router
from loadtest.children import stop_processes
from loadtest.llama_fleet import (
    MODEL_ALIAS,
    LlamaServer,
    find_llama,
    prose,
    start_servers,
    stop_server,
)
from loadtest.local_fleet import free_port

FLEET: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("a", ("-c", "4096", "-np", "4", "--kv-unified"), "unified"),
    ("b", ("-c", "4096", "-np", "4"), "partitioned"),
    ("c", ("-c", "4096", "-np", "2"), "partitioned"),
)
ROUTERS = (
    "kvroute",
    "round_robin",
    "idle_slots",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
)
SYSTEM = "Answer in one short paragraph."
# SmolLM2's chat template: <|im_start|>ROLE\n ... <|im_end|>\n per message (4 tokens and the
# role, which the gateway counts), <|im_start|>assistant\n (4 tokens) to prime the reply.
TOKENS_PER_MESSAGE, REPLY_PRIMING = 4, 4


@dataclass(frozen=True, slots=True)
class Job:
    arrival_s: float
    kind: str  # chat | document
    prompt_words: int
    body: dict[str, Any]


@dataclass
class Outcome:
    kind: str
    ok: bool
    failure: str = ""  # "HTTP 400", "stream error", "transport"
    ttft_s: float | None = None
    tokens: int = 0
    backend: str = ""
    detail: str = ""  # the error body or event, cut short
    # The user message's words: its tokens to the server (``prose``), the bulk of the prompt.
    prompt_words: int = 0
    # When the request was sent, seconds into the run (the list's arrival time).
    sent_s: float = 0.0


@dataclass
class RouterRun:
    router: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.ok]
        docs = [o for o in self.outcomes if o.kind == "document"]
        failures: dict[str, int] = {}
        for o in self.outcomes:
            if not o.ok:
                failures[o.failure] = failures.get(o.failure, 0) + 1
        return {
            "router": self.router,
            "requests": len(self.outcomes),
            "failed": len(self.outcomes) - len(ok),
            "documents_failed": sum(1 for o in docs if not o.ok),
            "documents": len(docs),
            "failures": failures,
            "ttft_p50_s": pct([o.ttft_s for o in ok], 0.5),
            "ttft_p99_s": pct([o.ttft_s for o in ok], 0.99),
            "document_ttft_p50_s": pct([o.ttft_s for o in ok if o.kind == "document"], 0.5),
            "document_ttft_p99_s": pct([o.ttft_s for o in ok if o.kind == "document"], 0.99),
            "goodput_requests_per_s": len(ok) / max(self.wall_s, 1e-9),
            "goodput_tokens_per_s": sum(o.tokens for o in ok) / max(self.wall_s, 1e-9),
            # The prompts served: a router that fails the longest documents at once has
            # less prefill to do in its wall time than one that serves them.
            "served_prompt_words_per_s": sum(o.prompt_words for o in ok) / max(self.wall_s, 1e-9),
            "wall_s": self.wall_s,
        }


def pct(xs: Sequence[float | None], q: float) -> float | None:
    got = sorted(x for x in xs if x is not None)
    return got[min(len(got) - 1, int(q * len(got)))] if got else None


def workload(args: argparse.Namespace) -> list[Job]:
    rng = random.Random(args.seed)
    jobs, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        doc = rng.random() < args.document_share
        words = rng.randint(700, 1800) if doc else rng.randint(60, 150)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": prose(words, rng)},
        ]
        body = {
            "model": MODEL_ALIAS,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "stream": True,
        }
        jobs.append(Job(t, "document" if doc else "chat", words, body))
    return jobs


async def send(client: httpx.AsyncClient, url: str, job: Job, t0: float) -> Outcome:
    """One streamed chat: ok when it ends with ``[DONE]`` and no error event came."""
    out = Outcome(job.kind, False, prompt_words=job.prompt_words, sent_s=job.arrival_s)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=job.body) as resp:
            out.backend = resp.headers.get("x-kvroute-backend", "")
            if resp.status_code != 200:
                out.detail = (await resp.aread())[:300].decode("utf-8", "replace")
                out.failure = f"HTTP {resp.status_code}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.ok = not out.failure
                    return out
                if '"error"' in data:
                    out.failure, out.detail = "stream error", data[:300]
                elif '"content"' in data:
                    out.ttft_s = out.ttft_s if out.ttft_s is not None else time.monotonic() - t0
                    out.tokens += 1
        out.failure = out.failure or "no [DONE]"
    except httpx.HTTPError as exc:
        out.failure = f"transport: {type(exc).__name__}"
    return out


async def drive(jobs: list[Job], pick: Any) -> tuple[list[Outcome], float]:
    """Send ``jobs`` open loop; ``pick(client)`` names the URL each one goes to."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.monotonic()
        tasks = []
        for job in jobs:
            delay = start + job.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            url = await pick(client)
            tasks.append(asyncio.create_task(send(client, url, job, time.monotonic())))
        outcomes = list(await asyncio.gather(*tasks))
        return outcomes, time.monotonic() - start


def fixed(url: str) -> Any:
    async def pick(_client: httpx.AsyncClient) -> str:
        return url

    return pick


def cycling(urls: Sequence[str]) -> Any:
    turn = itertools.cycle(urls)

    async def pick(_client: httpx.AsyncClient) -> str:
        return next(turn)

    return pick


def most_idle_slots(urls: Sequence[str]) -> Any:
    """paddler's rule: the server with the most idle slots; ties in turn."""
    turn = itertools.count()

    async def idle(client: httpx.AsyncClient, url: str) -> int:
        try:
            slots = (await client.get(url + "/slots", timeout=30)).json()
            return sum(1 for s in slots if not s.get("is_processing"))
        except (httpx.HTTPError, ValueError):
            return -1

    async def pick(client: httpx.AsyncClient) -> str:
        counts = await asyncio.gather(*(idle(client, u) for u in urls))
        best = max(counts)
        tied = [u for u, n in zip(urls, counts, strict=True) if n == best]
        return tied[next(turn) % len(tied)]

    return pick


def trace_fleet(url: str, path: Path, procs: list[Any]) -> None:
    """The gateway's ``/fleet`` twice a second, one JSON line each, while it runs."""
    with path.open("a") as out:
        while procs and procs[0].poll() is None:
            try:
                fleet = httpx.get(url + "/fleet", timeout=5).json()
                out.write(json.dumps({"t": time.time(), "backends": fleet["backends"]}) + "\n")
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)


def min_slot(servers: dict[str, LlamaServer]) -> int:
    """The smallest slot in the fleet (``-c`` over ``-np``, as ``FLEET`` starts each server)."""
    sizes = []
    for name, flags, _layout in FLEET:
        if name in servers:
            ctx, slots = int(flags[flags.index("-c") + 1]), int(flags[flags.index("-np") + 1])
            sizes.append(ctx if "--kv-unified" in flags else ctx // slots)
    return min(sizes)


def gateway_config(
    servers: dict[str, LlamaServer], model: Path, report_grace_s: float, timeout_s: float
) -> dict[str, Any]:
    layouts = {name: layout for name, _args, layout in FLEET}
    backends = [
        {"name": n, "url": s.url, "kind": "llamacpp", "kv_layout": layouts[n]}
        for n, s in servers.items()
    ]
    return {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "backends": backends,
        "sizing": {"tokenizer_file": str(model)},
        "models": {
            MODEL_ALIAS: {"tokens_per_message": TOKENS_PER_MESSAGE, "reply_priming": REPLY_PRIMING}
        },
        # One llama-server step (-b 512 tokens on one thread) runs before /slots answers.
        "collector": {
            "scrape_interval_s": 0.25,
            "timeout_s": timeout_s,
            "stale_after_s": max(30.0, 3 * timeout_s),
        },
        "queue": {"max_wait_s": 300.0},
        # Long: more than the fleet's smallest slot holds (b's 1,024). Long requests then
        # take the tightest slot that holds them (c's 2,048 before a's pool), and chats fill
        # the small slots first, keeping the big ones for documents (docs/backends.md).
        "routing": {"long_threshold_tokens": min_slot(servers)},
        # A request one partitioned slot holds waits in that server's queue, not the
        # gateway's: its first token may come as late as a hold would have ended.
        "upstream": {"ttfb_timeout_s": 300.0},
        "health": {"active": {"enabled": False}},
        "store": {"report_grace_s": report_grace_s},
    }


def run_router(router: str, jobs: list[Job], args: argparse.Namespace) -> RouterRun:
    binary, model = args.llama
    with tempfile.TemporaryDirectory(prefix="kvroute-llamacpp-") as tmp:
        workdir = Path(tmp)
        started = start_servers(binary, model, [a for _n, a, _l in FLEET], workdir)
        servers = {name: s for (name, _a, _l), s in zip(FLEET, started, strict=True)}
        urls = [s.url for s in started]
        procs = []
        try:
            peer = router.partition("vllm-router:")[2]
            if router == "kvroute":
                cfg = gateway_config(servers, model, args.report_grace, args.scrape_timeout)
                proc, url = start_gateway(cfg, workdir)
                procs.append(proc)
                pick = fixed(url)
                if args.trace is not None:
                    threading.Thread(
                        target=trace_fleet, args=(url, args.trace, procs), daemon=True
                    ).start()
            elif peer:
                workers = ["--worker-urls", *urls]
                proc, url = start_vllm_router(args.vllm_router_exe, peer, workers, workdir)
                procs.append(proc)
                pick = fixed(url)
            elif router == "round_robin":
                pick = cycling(urls)
            else:
                pick = most_idle_slots(urls)
            outcomes, wall = asyncio.run(drive(jobs, pick))
            return RouterRun(router, outcomes, wall)
        finally:
            stop_processes(procs)
            for s in started:
                stop_server(s)
            if args.keep_logs is not None:
                kept = args.keep_logs / router.replace(":", "-")
                kept.mkdir(parents=True, exist_ok=True)
                for log in workdir.glob("*.log"):
                    shutil.copy(log, kept / log.name)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| router | failed | documents failed | how | TTFT p50 / p99 (s) "
        "| document TTFT p50 / p99 (s) | goodput (req/s) | goodput (tok/s) "
        "| prompts served (words/s) |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [
        f"| {r['router']} | {r['failed']}/{r['requests']} "
        f"| {r['documents_failed']}/{r['documents']} "
        f"| {', '.join(f'{k}: {v}' for k, v in sorted(r['failures'].items())) or '-'} "
        f"| {fmt(r['ttft_p50_s'])} / {fmt(r['ttft_p99_s'])} "
        f"| {fmt(r['document_ttft_p50_s'])} / {fmt(r['document_ttft_p99_s'])} "
        f"| {r['goodput_requests_per_s']:.3f} | {r['goodput_tokens_per_s']:.1f} "
        f"| {r.get('served_prompt_words_per_s', 0.0):.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench llamacpp", description=__doc__)
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=0.6, help="arrivals per second")
    p.add_argument("--document-share", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--vllm-router", default=None, help="path of vllm-router (default: PATH, venv)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--report-grace",
        type=float,
        default=0.25,
        help="kvroute's store.report_grace_s (its default): how long before a report a "
        "reservation still counts as not in it (docs/backends.md#llamacpp)",
    )
    p.add_argument("--keep-logs", type=Path, default=None, help="copy each run's logs here")
    p.add_argument(
        "--scrape-timeout",
        type=float,
        default=10.0,
        help="kvroute's collector.timeout_s: llama-server answers /slots and /metrics each "
        "after a step of its loop, seconds on a loaded CPU",
    )
    p.add_argument("--trace", type=Path, default=None, help="kvroute's /fleet, twice a second")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    found = find_llama()
    if isinstance(found, str):
        print(f"cannot run: {found}", flush=True)
        return 2
    args.llama = found
    routers = args.routers.split(",")
    args.vllm_router_exe = find_vllm_router(args.vllm_router)
    if args.vllm_router_exe is None and any(r.startswith("vllm-router:") for r in routers):
        print("vllm-router skipped: not installed (PATH, /tmp/vllm-router-venv)", flush=True)
        routers = [r for r in routers if not r.startswith("vllm-router:")]
    jobs = workload(args)
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for router in routers:
        run = run_router(router, jobs, args)
        rows.append(run.summary())
        print(f"{router}: {json.dumps(rows[-1])}", flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            raw += [{"router": router, **asdict(o)} for o in run.outcomes]
            args.json.write_text(json.dumps({"rows": rows, "outcomes": raw}, indent=1))
    print(table(rows))
    return 0
