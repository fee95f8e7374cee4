"""Experiments, behind one entry: ``python -m loadtest.lab <subcommand> [args]``.

Not benchmarks a user runs on a fleet (those are ``python -m loadtest.bench``): each of
these answered one design question (an offline bound, a pool size, a store's cost, an A/B
of two checkouts), and is kept so the answer can be measured again. Each subcommand is a
module of this package with a ``main(argv)``, imported only when chosen; docs/lab/ says
what each one found.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from loadtest.subcommands import dispatch

#: subcommand -> (module under loadtest.lab, what it measures)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pd-floor": ("pd_floor", "the pd run's lowest TTFT p99 with no preemption, offline (MILP)"),
    "pd-online": ("pd_online", "the pd run's TTFT p99 per decode placement, none held back"),
    "encode-pools": ("encode_pools", "new documents encoded serially, in threads, in processes"),
    "store-forgotten": (
        "store_forgotten",
        "what forgotten reservations cost the Redis store's reserve",
    ),
    "ab": ("tree_ab", "two checkouts of kvroute, alternating rounds: paired ratios"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    head = "usage: python -m loadtest.lab <subcommand> [args]\n\nexperiments:\n"
    return head + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    return dispatch("loadtest.lab", SUBCOMMANDS, usage, argv)


if __name__ == "__main__":
    sys.exit(main())
