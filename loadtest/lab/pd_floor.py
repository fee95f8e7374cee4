"""How long must a request wait for a decode server if none may ever preempt? An offline floor.

The disaggregation benchmark (``loadtest.bench.pd``) asks two things at once of its heavy load:
no preemption on the decode servers, and a TTFT p99 well below a router's that admits at
once and lets its decode servers preempt. Whether both can hold on a request list is a
question about the list, not about any router: this module answers it with every request's
arrival and output length known in advance (which no router knows), as a mixed-integer
program (scipy's HiGHS).

The model, each part a relaxation of the simulated fleet, so its answer is a **lower bound**
for every router, online or not:

* a request occupies one decode server from its start until its last token, holding its
  prompt plus one token per ``1 / decode_tps`` s (the simulated engines decode each request
  at a fixed rate, whatever the batch); KV is counted in tokens, not 16-token blocks;
* a server's KV (``capacity_tokens``) and running slots (``max_num_seqs``) are never
  exceeded: exceeding the KV is what a preemption is;
* prefill, the transfer and the first token take no time (they only add to a real TTFT).

Time is cut in steps of ``dt``, checked at step boundaries. A schedule's starts moved up to
the next boundary, each request counted one step shorter, hold no more at any boundary than
the schedule did, and wait at most ``dt`` longer. So if no grid schedule keeps every wait
within ``D + dt``, no schedule at all keeps it within ``D``: :func:`wait_floor` returns the
largest ``D`` so shown, by bisection.

The largest wait is the p99 while a list has fewer than 100 requests (``xs[int(0.99 n)]`` is
then the maximum); with ``exceed`` > 0 that many requests may wait as long as they need.

    python -m loadtest.lab pd-floor --quick --rate 3 --decode-capacity 12000 --seeds 7,8,9
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadtest.workload import Request

SCIPY_HINT = (
    "the offline floor needs scipy: pip install 'kvroute[loadtest]' "
    "(in a clone: pip install -e '.[loadtest]')"
)
try:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix
except ImportError as exc:  # tests/test_extras.py runs this without scipy
    raise SystemExit(SCIPY_HINT) from exc


@dataclass(frozen=True, slots=True)
class DecodeFleet:
    """The decode servers, all alike."""

    servers: int
    capacity_tokens: int
    decode_tps: float  # per request, after any speedup
    max_num_seqs: int = 32


def feasible(
    requests: Sequence[Request],
    fleet: DecodeFleet,
    wait_s: float,
    dt: float = 0.05,
    exceed: int = 0,
    time_limit_s: float = 120.0,
) -> bool:
    """Whether some grid schedule (module docstring) starts every request within ``wait_s + dt``
    of its arrival, ``exceed`` of them excepted, with no server over its KV or slots.

    ``True`` also when the solver runs out of time: a floor must never rise on an unknown.
    """
    late = max((r.output_tokens / fleet.decode_tps for r in requests), default=0.0)
    horizon = max((r.arrival_s for r in requests), default=0.0) + wait_s + 2 * dt + late
    if exceed:
        horizon += late + sum(r.output_tokens for r in requests) / fleet.decode_tps
    steps = int(horizon / dt) + 2
    columns: list[tuple[int, int, int, bool]] = []  # request, server, start step, late start
    for i, r in enumerate(requests):
        first = math.ceil(r.arrival_s / dt - 1e-9)
        last = math.floor((r.arrival_s + wait_s + dt) / dt + 1e-9)
        end = steps - 1 if exceed else last
        for k in range(fleet.servers):
            for s in range(first, end + 1):
                columns.append((i, k, s, s > last))
    rows: list[int] = []
    cols: list[int] = []
    kv: list[float] = []
    for c, (i, k, s, _) in enumerate(columns):
        r = requests[i]
        held = math.ceil(r.output_tokens / fleet.decode_tps / dt) - 1  # one step shorter
        for j in range(max(0, min(held, steps - s))):
            rows.append(k * steps + s + j)
            cols.append(c)
            kv.append(r.prompt_tokens + fleet.decode_tps * j * dt)
    n = len(columns)
    shape = (fleet.servers * steps, n)
    memory = coo_matrix((kv, (rows, cols)), shape=shape).tocsr()
    slots = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=shape).tocsr()
    once = coo_matrix(
        (np.ones(n), ([c[0] for c in columns], range(n))), shape=(len(requests), n)
    ).tocsr()
    constraints = [
        LinearConstraint(memory, -np.inf, fleet.capacity_tokens),
        LinearConstraint(slots, -np.inf, fleet.max_num_seqs),
        LinearConstraint(once, 1, 1),
    ]
    if exceed:
        lates = np.array([1.0 if c[3] else 0.0 for c in columns])
        constraints.append(LinearConstraint(lates.reshape(1, -1), -np.inf, exceed))
    upper = np.ones(n)
    # The servers are alike: the first request on the first one.
    upper[[c for c, col in enumerate(columns) if col[0] == 0 and col[1] > 0]] = 0
    res = milp(
        np.zeros(n),
        constraints=constraints,
        integrality=np.ones(n),
        bounds=Bounds(0, upper),
        options={"time_limit": time_limit_s},
    )
    return bool(res.status != 2)  # 2: infeasible; solved or out of time count as feasible


def wait_floor(
    requests: Sequence[Request],
    fleet: DecodeFleet,
    dt: float = 0.05,
    exceed: int = 0,
    most_s: float = 60.0,
    time_limit_s: float = 120.0,
) -> float:
    """The largest wait shown to be unavoidable; ``most_s`` if all are.

    Below the true floor by at most a step per request in the longest chain of requests
    that wait for one another (each is counted a step shorter), one for the grid's start,
    and a quarter of one for the bisection. A solve that runs out of ``time_limit_s`` counts
    as feasible, so a hard instance lowers the floor rather than raising it.
    """

    def fits(wait_s: float) -> bool:
        return feasible(requests, fleet, wait_s, dt, exceed, time_limit_s)

    if fits(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while not fits(hi):
        lo, hi = hi, 2 * hi
        if lo >= most_s:
            return most_s
    while hi - lo > dt / 4:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.bench.engine_fleet import DECODE_TOKENS_PER_S
    from loadtest.bench.pd import build_parser, workload_requests

    p = argparse.ArgumentParser(
        prog="python -m loadtest.lab pd-floor",
        parents=[build_parser()],
        add_help=False,
        description=__doc__,
    )
    p.add_argument("--seeds", default=None, help="comma-separated (default: --seed)")
    p.add_argument("--dt", type=float, default=0.05)
    p.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    args = p.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 20.0)
    rate = DECODE_TOKENS_PER_S * args.speedup
    fleet = DecodeFleet(2, args.decode_capacity, rate, args.max_num_seqs)
    for seed in (args.seeds or str(args.seed)).split(","):
        args.seed = int(seed)
        requests = workload_requests(args)
        n = len(requests)
        exceed = n - int(0.99 * n) - 1
        floor_s = wait_floor(requests, fleet, args.dt, exceed, time_limit_s=args.time_limit)
        print(
            f"seed {seed}: {n} requests; with no decode preemption, the TTFT p99 of any router "
            f"is at least {floor_s:.2f} s (the wait for a decode server alone)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
