"""Soak: run the gateway under the problem's workload for a long while and watch its resources.

Not a test: a script (``python -m loadtest.bench.soak --duration-s 600``). It starts a local fleet
as real processes (Redis, engines, the gateway), sends the problem statement's mix (70%
short chat requests, 30% long documents of 15k-30k tokens, Poisson arrivals) open-loop,
and every ``--interval-s`` reads the gateway process's resident memory, open file
descriptors and TCP connections from /proc. A leak shows as growth that does not level
off; the summary compares the second half of the run with the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from loadtest.bench.proc_stats import proc_rss_mib, proc_sockets, proc_tcp
from loadtest.local_fleet import EngineSpec, LocalFleet
from loadtest.workload import bimodal, chat_overhead_tokens, make_prompt


@dataclass
class Sample:
    t_s: float
    rss_mib: float
    fds: int
    tcp_established: int
    tcp_other: int
    sent: int
    ok: int
    failed: int
    no_answer: int
    inflight: int


class Load:
    """Open-loop sender with counts; prompt text is cached per size bucket (sizes are what matter)."""

    def __init__(self, url: str, max_inflight: int) -> None:
        self.url = url + "/v1/chat/completions"
        self.sem = asyncio.Semaphore(max_inflight)
        self.counts: Counter[str] = Counter()
        self.inflight = 0
        self._prompts: dict[int, str] = {}
        self._rng = random.Random(1)

    def prompt(self, tokens: int) -> str:
        bucket = max(1, tokens // 250 * 250)
        if bucket not in self._prompts:
            self._prompts[bucket] = make_prompt(bucket, self._rng)
        return self._prompts[bucket]

    async def one(
        self, client: httpx.AsyncClient, prompt_tokens: int, output_tokens: int, stream: bool
    ) -> None:
        body = {
            "model": "sim-model",
            "messages": [
                {
                    "role": "user",
                    "content": self.prompt(max(1, prompt_tokens - chat_overhead_tokens())),
                }
            ],
            "max_tokens": output_tokens,
            "stream": stream,
        }
        async with self.sem:
            self.inflight += 1
            self.counts["sent"] += 1
            try:
                if stream:
                    async with client.stream("POST", self.url, json=body) as resp:
                        await resp.aread()
                        status = resp.status_code
                else:
                    status = (await client.post(self.url, json=body)).status_code
                self.counts["ok" if status == 200 else "failed"] += 1
                self.counts[f"status_{status}"] += 1
            except httpx.HTTPError:
                self.counts["no_answer"] += 1
            finally:
                self.inflight -= 1


async def soak(args: argparse.Namespace) -> dict[str, object]:
    specs = [EngineSpec(name="long-0", pool="long", speedup=args.speedup)] + [
        EngineSpec(name=f"general-{i}", speedup=args.speedup) for i in range(args.engines - 1)
    ]
    samples: list[Sample] = []
    with LocalFleet(specs, use_redis=not args.no_redis) as fleet:
        assert fleet.gateway is not None and fleet.gateway.popen is not None
        pid = fleet.gateway.popen.pid
        load = Load(fleet.gateway_url, args.max_inflight)
        requests = bimodal(args.rate, duration_s=args.duration_s, seed=args.seed)
        rng = random.Random(args.seed)
        start = time.monotonic()

        async def monitor() -> None:
            while True:
                fds, inodes = proc_sockets(pid)
                tcp = proc_tcp(pid, inodes)
                c = load.counts
                s = Sample(
                    round(time.monotonic() - start, 1), round(proc_rss_mib(pid), 1), fds, tcp["established"],
                    sum(tcp.values()) - tcp["established"], c["sent"], c["ok"], c["failed"], c["no_answer"], load.inflight,
                )  # fmt: skip
                samples.append(s)
                print(json.dumps(asdict(s)), flush=True)
                await asyncio.sleep(args.interval_s)

        limits = httpx.Limits(
            max_connections=args.max_inflight, max_keepalive_connections=args.max_inflight
        )
        async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
            mon = asyncio.create_task(monitor())
            tasks: set[asyncio.Task[None]] = set()
            for req in requests:
                delay = start + req.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                t = asyncio.create_task(
                    load.one(
                        client,
                        req.prompt_tokens,
                        req.output_tokens,
                        rng.random() < args.stream_share,
                    )
                )
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
            await asyncio.sleep(
                min(args.interval_s, 5.0)
            )  # one sample after the load: idle figures
            mon.cancel()
            fds, inodes = proc_sockets(pid)
            idle = {
                "rss_mib": round(proc_rss_mib(pid), 1),
                "fds": fds,
                "tcp": dict(proc_tcp(pid, inodes)),
            }
    return summarize(samples, dict(load.counts), idle)


def summarize(
    samples: Sequence[Sample], counts: dict[str, int], idle: dict[str, object]
) -> dict[str, object]:
    half = len(samples) // 2
    first, second = samples[1:half] or samples[:1], samples[half:] or samples[-1:]

    def peak(xs: Sequence[Sample], attr: str) -> float:
        return max(float(getattr(s, attr)) for s in xs)

    return {
        "samples": len(samples),
        "counts": counts,
        "rss_mib": {
            "start": samples[0].rss_mib,
            "peak_first_half": peak(first, "rss_mib"),
            "peak_second_half": peak(second, "rss_mib"),
            "end": samples[-1].rss_mib,
        },
        "fds": {
            "start": samples[0].fds,
            "peak_first_half": peak(first, "fds"),
            "peak_second_half": peak(second, "fds"),
            "end": samples[-1].fds,
        },
        "tcp_established": {
            "peak_first_half": peak(first, "tcp_established"),
            "peak_second_half": peak(second, "tcp_established"),
        },
        "after_load": idle,
        "levels_off": peak(second, "rss_mib") <= 1.10 * peak(first, "rss_mib")
        and peak(second, "fds") <= 1.10 * peak(first, "fds") + 8,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if "--faults" in args_in:
        # The multi-replica fleet under faults: its own options (loadtest.bench.soak_faults).
        from loadtest.bench import soak_faults

        return soak_faults.main(args_in)
    p = argparse.ArgumentParser(
        prog="kvroute soak", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=600.0,
        help="how long to send load (default 600 = 10 min)",
    )
    p.add_argument(
        "--interval-s", type=float, default=15.0, help="seconds between resource samples"
    )
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    p.add_argument(
        "--engines", type=int, default=3, help="engines: one long-pool node plus general ones"
    )
    p.add_argument("--speedup", type=float, default=50.0, help="engine simulated-time speedup")
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--max-inflight", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-redis", action="store_true", help="embedded store instead of redis-server")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here")
    args = p.parse_args(args_in)
    summary = asyncio.run(soak(args))
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0 if summary["levels_off"] else 1


if __name__ == "__main__":
    sys.exit(main())
