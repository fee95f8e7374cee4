"""The lowest TTFT p99 a router reaches if it never holds a request that fits: every placement tried.

``loadtest.lab.pd_floor`` bounds the wait for a decode server over *every* schedule, with
the whole request list known in advance. Its schedules hold requests back on purpose: a
document waits a second although a server fits it, so that the document after it finds
room. An online router cannot know that a later document is coming. This module asks the
narrower question for the routers that do not hold back (work-conserving): a request starts
the moment a decode server fits it. Then the only freedom left is *which* server, whenever
more than one fits, and this module tries every such choice for the documents.

The model is ``pd_floor``'s: a request occupies one decode server from its start to its last
token, holding its prompt plus one token per ``1 / decode_tps`` s; a server's KV and slots
are never exceeded. A server fits a request when its in-flight requests' joint peak with the
new one (``proxy.core.projection.projected_peak``: exact here, every output length known, one
rate for all, no later arrival counted) stays within its KV. In tokens, with no safety margin:
nothing kvroute's own margins would add.

What is enumerated and what is fixed:

* every document (``kind == "long"``) that more than one server fits may go to any of them
  (servers holding the same requests count once);
* a chat goes to the server with the lower projected peak (spread, as kvroute places it);
* at each arrival and each request's end, waiting requests start in arrival order, each on
  a server that fits it; a later one may start while an earlier one still waits.

The search is depth first and stops a branch once its longest wait reaches the best found
(the p99 is the longest wait on lists of fewer than 100 requests, as the pd runs are).

    python -m loadtest.lab pd-online --quick --rate 3 --decode-capacity 12000 --seeds 7,8,9
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.lab.pd_floor import DecodeFleet
from loadtest.workload import Request
from proxy.core.projection import Flight, projected_peak


@dataclass(frozen=True, slots=True)
class Running:
    """A request on a decode server: it holds its prompt plus what it has written so far."""

    start_s: float
    prompt_tokens: int
    output_tokens: int

    def end_s(self, tps: float) -> float:
        return self.start_s + self.output_tokens / tps

    def flight(self, now: float, tps: float) -> Flight:
        written = min(self.output_tokens, max(0, math.floor((now - self.start_s) * tps)))
        return Flight(self.prompt_tokens, self.output_tokens, self.output_tokens, written)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One schedule: its longest wait, or None where it was cut off (no better than the best)."""

    longest_wait_s: float | None
    # The options at each document choice point met, in order (every one at least 2).
    options: list[int]


@dataclass(slots=True)
class _Fleet:
    fleet: DecodeFleet
    servers: list[list[Running]] = field(default_factory=list)

    def live(self, k: int, now: float) -> list[Running]:
        tps = self.fleet.decode_tps
        self.servers[k] = [r for r in self.servers[k] if r.end_s(tps) > now + 1e-9]
        return self.servers[k]

    def peak(self, k: int, now: float, new: Request | None = None) -> int:
        tps = self.fleet.decode_tps
        flights = [r.flight(now, tps) for r in self.live(k, now)]
        if new is not None:
            flights.append(Flight(new.prompt_tokens, new.output_tokens, new.output_tokens))
        return projected_peak(flights)

    def fitting(self, r: Request, now: float) -> list[int]:
        """Servers that fit ``r`` now, lowest projected peak first; alike servers once."""
        seen: set[tuple[Running, ...]] = set()
        out: list[tuple[int, int]] = []
        for k in range(self.fleet.servers):
            live = self.live(k, now)
            key = tuple(sorted(live, key=lambda x: (x.start_s, x.prompt_tokens)))
            if key in seen or len(live) >= self.fleet.max_num_seqs:
                continue
            if self.peak(k, now, r) <= self.fleet.capacity_tokens:
                seen.add(key)
                out.append((self.peak(k, now), k))
        return [k for _p, k in sorted(out)]

    def next_end(self, now: float) -> float:
        tps = self.fleet.decode_tps
        ends = [r.end_s(tps) for s in self.servers for r in s if r.end_s(tps) > now + 1e-9]
        return min(ends, default=math.inf)


def simulate(
    requests: Sequence[Request],
    fleet: DecodeFleet,
    choices: Sequence[int] = (),
    cutoff_s: float = math.inf,
    default: int = 0,
) -> Outcome:
    """One work-conserving schedule: ``choices[i]`` picks at the i-th document choice point
    (an index into the fitting servers, lowest peak first); past them, ``default`` (0: the
    lowest peak, spread; -1: the highest that fits, best fit)."""
    state = _Fleet(fleet, [[] for _ in range(fleet.servers)])
    arrivals = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    nxt = 0
    waiting: list[int] = []
    options: list[int] = []
    longest = 0.0
    now = 0.0
    while nxt < len(arrivals) or waiting:
        # Nothing changes between events: an arrival, or (for those waiting) an end.
        t_arrival = requests[arrivals[nxt]].arrival_s if nxt < len(arrivals) else math.inf
        now = min(t_arrival, state.next_end(now) if waiting else math.inf)
        if math.isinf(now):
            raise ValueError("a request fits no empty decode server: no schedule serves it")
        while nxt < len(arrivals) and requests[arrivals[nxt]].arrival_s <= now + 1e-9:
            waiting.append(arrivals[nxt])
            nxt += 1
        still: list[int] = []
        for i in waiting:
            r = requests[i]
            fit = state.fitting(r, now)
            if not fit:
                still.append(i)
                continue
            pick = 0
            if r.kind == "long" and len(fit) > 1:
                pick = choices[len(options)] if len(options) < len(choices) else default
                options.append(len(fit))
            state.servers[fit[pick]].append(Running(now, r.prompt_tokens, r.output_tokens))
            longest = max(longest, now - r.arrival_s)
            if longest >= cutoff_s:
                return Outcome(None, options)
        waiting = still
    return Outcome(longest, options)


@dataclass(frozen=True, slots=True)
class Search:
    """The best work-conserving placement found, and how far the search went."""

    best_s: float
    best_choices: tuple[int, ...]
    schedules: int  # simulated (cut-off ones included)
    complete: bool  # every placement tried or ruled out; else stopped at ``max_schedules``


def best_placement(
    requests: Sequence[Request], fleet: DecodeFleet, max_schedules: int = 20_000
) -> Search:
    """Every document placement (depth first), branches cut once no better than the best.

    A prefix fixes the first choices; the schedule simulated for it takes the first option
    beyond them, and its other options at each later choice point are the children. So
    each placement is simulated once, and a branch cut at a request's wait ends every
    placement that shares its choices up to that request (their waits so far are the same).
    """
    first = simulate(requests, fleet)
    assert first.longest_wait_s is not None  # no cutoff: never cut
    best, best_choices = first.longest_wait_s, tuple(0 for _ in first.options)
    stack = _children((), first.options)
    schedules = 1
    while stack and schedules < max_schedules:
        prefix = stack.pop()
        run = simulate(requests, fleet, prefix, cutoff_s=best)
        schedules += 1
        if run.longest_wait_s is not None and run.longest_wait_s < best:
            best = run.longest_wait_s
            best_choices = prefix + tuple(0 for _ in run.options[len(prefix) :])
        stack.extend(_children(prefix, run.options))
    return Search(best, best_choices, schedules, complete=not stack)


def _children(prefix: tuple[int, ...], options: Sequence[int]) -> list[tuple[int, ...]]:
    """The prefixes that differ from ``prefix`` + first options at exactly one later point."""
    out: list[tuple[int, ...]] = []
    for depth in range(len(prefix), len(options)):
        zeros = (0,) * (depth - len(prefix))
        out.extend(prefix + zeros + (alt,) for alt in range(1, options[depth]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from loadtest.bench.engine_fleet import DECODE_TOKENS_PER_S
    from loadtest.bench.pd import build_parser, workload_requests

    p = argparse.ArgumentParser(
        prog="python -m loadtest.lab pd-online",
        parents=[build_parser()],
        add_help=False,
        description=__doc__,
    )
    p.add_argument("--seeds", default=None, help="comma-separated (default: --seed)")
    p.add_argument(
        "--max-schedules", type=int, default=20_000, help="stop the search after this many"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 20.0)
    rate = DECODE_TOKENS_PER_S * args.speedup
    fleet = DecodeFleet(2, args.decode_capacity, rate, args.max_num_seqs)
    print(
        "| seed | requests | documents | spread (s) | best fit (s) | best placement (s) | schedules |"
    )
    print("|---|---|---|---|---|---|---|")
    for seed in (args.seeds or str(args.seed)).split(","):
        args.seed = int(seed)
        requests = workload_requests(args)
        docs = sum(1 for r in requests if r.kind == "long")
        spread = simulate(requests, fleet).longest_wait_s
        best_fit = simulate(requests, fleet, default=-1).longest_wait_s
        found = best_placement(requests, fleet, args.max_schedules)
        tried = f"{found.schedules}" + ("" if found.complete else " (cut: a bound from above)")
        print(
            f"| {seed} | {len(requests)} | {docs} | {spread:.2f} | {best_fit:.2f} "
            f"| {found.best_s:.2f} | {tried} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
