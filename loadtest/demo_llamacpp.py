"""`kvroute demo --engine llamacpp`: three real llama-servers, kvroute against blind routers.

The fleet of ``python -m loadtest.bench llamacpp``, at a demo's size: three ``llama-server``
processes (SmolLM2-135M, one thread each) with the same 4,096 cells laid out three ways (one
unified pool of 4 slots, four slots of 1,024, two of 2,048), and the same open-loop list of
streamed chats and documents sized around the slots through kvroute, a client-side round
robin and the most-idle-slots rule paddler balances by. A document sent to a slot that
cannot hold it fails (400 ``exceed_context_size_error``), and an overfilled unified pool fails
every request in flight there (500): kvroute reads the slots and places each request where it
fits. It needs llama.cpp's server and a model from PyPI; without them it says how to get them.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from loadtest.bench.llamacpp import build_parser, run_router, table, workload
from loadtest.llama_fleet import find_llama

ROUTERS = ("kvroute", "round_robin", "idle_slots")


def conclusion(rows: list[dict[str, Any]]) -> str:
    """One line: each router's failed requests, kvroute first."""
    parts = [f"{r['router']} {r['failed']}/{r['requests']}" for r in rows]
    return "conclusion: failed requests: " + ", ".join(parts)


def run(requests: int, rate: float, seed: int, console: Console) -> int:
    """The three routers in turn, fresh servers for each; 2 when llama.cpp is missing."""
    found = find_llama()
    if isinstance(found, str):
        console.print(f"[bold]kvroute demo --engine llamacpp[/] cannot start: {found}")
        return 2
    args: argparse.Namespace = build_parser().parse_args(
        ["--requests", str(requests), "--rate", str(rate), "--seed", str(seed)]
    )
    args.llama = found
    jobs = workload(args)
    console.print(
        f"[bold]kvroute demo[/]: 3 llama-servers (a unified pool of 4 slots, 4 slots of 1,024, "
        f"2 of 2,048), {requests} streamed requests at {rate:g}/s, 30% documents; "
        "the same requests through each router, fresh servers each time"
    )
    rows = []
    for router in ROUTERS:
        console.print(f"[dim]{router}: running...[/]")
        rows.append(run_router(router, jobs, args).summary())
    console.print(table(rows), markup=False, soft_wrap=True)
    console.print(conclusion(rows), markup=False)
    return 0
