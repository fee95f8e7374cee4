"""The benchmarks users run, behind one entry: ``python -m loadtest.bench <subcommand> [args]``.

Each subcommand is a module of this package with a ``main(argv) -> int | None``; it is
imported only when chosen, so one benchmark's dependencies (locust, wrk, redis-server) do
not stand in another's way. Registering a benchmark is one line in ``SUBCOMMANDS``; each
one is documented in docs/benchmarks.md. ``python -m loadtest.bench <subcommand> --help``
shows its own options. Experiments (offline bounds, pool sizes, A/B of two checkouts) are
``python -m loadtest.lab``; nothing here imports them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from loadtest.subcommands import dispatch

#: subcommand -> (module under loadtest.bench, what it measures)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "overhead": ("overhead", "gateway overhead vs direct, a bare proxy and vllm-router"),
    "routing": ("routing", "the routing decision's cost, tokenization included; loop lag"),
    "sizing": ("sizing", "what sizing a request costs; cl100k vs a model's tokenizer"),
    "compare": ("compare_e2e", "one workload through the gateway: round robin vs kvroute"),
    "prefix": ("prefix", "prefix-cache affinity on a shared-document workload"),
    "prefix-replicas": ("prefix_replicas", "two gateway replicas, sharing the prefix index or not"),
    "queueing": ("queueing", "queueing (vLLM-like) backends near saturation, by policy"),
    "kv-events": ("kv_events", "prefix routing on vLLM's KV-cache events vs its own guess"),
    "memory-pressure": ("memory_pressure", "paged engines short of KV: preemptions, goodput, TTFT"),
    "pd": ("pd", "disaggregated prefill and decode: kvroute vs vllm-router's PD mode"),
    "continuation": ("continuation", "one engine of four killed under streaming load"),
    "big-prompts": ("big_prompts", "big prompts at high concurrency: sizing, the chunk cache"),
    "soak": ("soak", "a long run under the problem's mix: the gateway's memory, files, tasks"),
    "locust": ("locustfile", "locust users against a local fleet (arguments after --)"),
    "do-no-harm": ("do_no_harm", "kvroute vs vllm-router's policies, two engine models, verdicts"),
    "llamacpp": ("llamacpp", "real llama.cpp servers, mixed slot layouts: failures, TTFT, goodput"),
    "epp": ("epp", "Envoy + kvroute's endpoint picker vs kvroute serve and vllm-router"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    head = "usage: python -m loadtest.bench <subcommand> [args]\n\nsubcommands:\n"
    lab = (
        "\n\nexperiments (offline bounds, pool sizes, A/B of two checkouts): python -m loadtest.lab"
    )
    return head + "\n".join(lines) + lab


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch("loadtest.bench", SUBCOMMANDS, usage, argv)


if __name__ == "__main__":
    sys.exit(main())
