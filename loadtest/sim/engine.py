"""Discrete-event fleet simulator: allocator models + the gateway's own routing policy.

One heap of timed events (completions, samples, restarts, client retries, scrapes) merged
with a lazy arrival stream. Each arrival builds a ``FleetSnapshot`` from the allocators
(only nodes that changed are rebuilt) and asks ``proxy.routing.policy`` for a ranking, exactly as
the gateway does, then tries candidates in order like the gateway's retry loop. Time is
simulated, so days of uptime take seconds to minutes.

``oracle`` is the no-fragmentation bound: every node compacts perfectly (a request fits
wherever the node's total free memory holds it), placed on the node with the most free.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from loadtest.engine.allocators import make_allocator
from loadtest.sim.model import HIGH_FREE, POLICY_NAMES, RESTART_MODES, SimConfig, SimResult
from loadtest.sim.workload import ReqLike
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.routing import Policy, RouteRequest, classify, make_policy

__all__ = [
    "POLICY_NAMES",
    "RESTART_MODES",
    "SimConfig",
    "SimResult",
    "Simulation",
    "simulate",
    "with_nodes",
]


_COMPLETE, _SAMPLE, _RESTART_UP, _RETRY, _SCRAPE, _EXPIRE = 0, 1, 2, 3, 4, 5


class _Compact:
    """Perfectly compacting memory for the oracle: fits whatever the total free holds."""

    kind = "contiguous"
    block_size = 1
    __slots__ = ("_cap", "_free", "_live")

    def __init__(self, capacity: int) -> None:
        self._cap = capacity
        self._free = capacity
        self._live: dict[object, int] = {}

    capacity_tokens = property(lambda self: self._cap)
    free_tokens = property(lambda self: self._free)
    largest_free_block_tokens = property(lambda self: self._free)
    num_allocations = property(lambda self: len(self._live))

    def allocate(self, rid: object, tokens: int) -> int | None:
        if tokens > self._free:
            return None
        self._free -= tokens
        self._live[rid] = tokens
        return 0

    def free(self, rid: object) -> int:
        t = self._live.pop(rid, 0)
        self._free += t
        return t

    def reset(self) -> None:
        self._free = self._cap
        self._live = {}


class _Node:
    __slots__ = (
        "alloc", "ceiling", "ceiling_set", "ceiling_until", "down", "drain_started", "draining",
        "frag_since", "inflight", "live", "name", "pending", "report", "restarts", "role",
        "started_at", "view",
    )  # fmt: skip

    def __init__(self, name: str, role: str, alloc: Any) -> None:
        self.name = name
        self.role = role
        self.alloc = alloc
        self.down = False
        self.draining = False
        self.drain_started = 0.0
        self.started_at = 1e-9
        self.inflight = 0
        self.live: set[int] = set()
        self.ceiling: int | None = None
        self.ceiling_set = 0.0
        self.ceiling_until = 0.0
        self.frag_since: float | None = None
        self.restarts = 0
        self.view: NodeView | None = None
        self.report: MemoryReport | None = None  # lag mode: the last scrape
        self.pending: dict[int, int] = {}  # lag mode: placed after the last scrape

    def fragmentation(self) -> float:
        a = self.alloc
        free = a.free_tokens
        return 0.0 if free <= 0 else 1.0 - min(1.0, a.largest_free_block_tokens / free)

    def memory_report(self, now: float) -> MemoryReport:
        a = self.alloc
        return MemoryReport(
            capacity_tokens=a.capacity_tokens,
            free_tokens=a.free_tokens,
            largest_free_block_tokens=a.largest_free_block_tokens,
            allocator=a.kind,
            block_size=a.block_size,
            running=self.inflight,
            started_at=self.started_at,
            reported_at=now,
        )


class _Pending:
    """A request between arrival and placement (or giving up): what the gateway tracks."""

    __slots__ = (
        "attempts",
        "deadline",
        "demand",
        "exclude",
        "failed",
        "queued_at",
        "req",
        "retries_left",
    )

    def __init__(
        self, demand: int, req: ReqLike, exclude: frozenset[str], retries_left: int
    ) -> None:
        self.demand = demand
        self.req = req
        self.exclude = exclude
        self.retries_left = retries_left
        self.attempts = 0
        self.failed: set[str] = set()
        self.deadline: float | None = None
        self.queued_at: float | None = None


ProgressFn = Callable[[float], None]


class Simulation:
    """One run of one policy over one request stream."""

    def __init__(self, cfg: SimConfig, policy: str) -> None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {list(POLICY_NAMES)}")
        if cfg.restart not in RESTART_MODES:
            raise ValueError(
                f"unknown restart mode {cfg.restart!r}; choose one of {list(RESTART_MODES)}"
            )
        if not 0 <= cfg.long_pool <= cfg.nodes:
            raise ValueError(
                f"long_pool ({cfg.long_pool}) must be between 0 and nodes ({cfg.nodes})"
            )
        self.cfg = cfg
        self.oracle = policy == "oracle"
        self.policy: Policy | None = None if self.oracle else make_policy(policy, cfg.settings)
        pools = policy == "kvroute"
        self.nodes: list[_Node] = []
        for i, name in enumerate(cfg.node_names()):
            role = "long" if pools and i >= cfg.nodes - cfg.long_pool else "general"
            alloc: Any = (
                _Compact(cfg.capacity_tokens)
                if self.oracle
                else make_allocator(cfg.allocator, cfg.capacity_tokens, cfg.block_size)
            )
            self.nodes.append(_Node(name, role, alloc))
        self.by_name = {n.name: n for n in self.nodes}
        self.res = SimResult(policy=policy, config=cfg)
        for n in self.nodes:
            self.res.series_frag[n.name] = []
            self.res.series_free[n.name] = []
            self.res.series_largest[n.name] = []
            self.res.series_uptime[n.name] = []
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.rid = 0
        self.holds = cfg.hold.sampler(cfg.seed)
        self.live_req: dict[int, tuple[_Node, int]] = {}  # rid -> (node, tokens)
        self.restarting: _Node | None = None
        self.bucket_fail = 0
        self.bucket_req = 0
        self.lag = cfg.report_lag_s > 0
        self.waiting: dict[int, _Pending] = {}
        self.qid = 0
        self.snap_at = -1.0
        self.refresh_s = max(1e-3, cfg.settings.stale_after_s / 2)

    # --- event plumbing -------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def run(
        self, requests: Iterable[ReqLike], duration_s: float, progress: ProgressFn | None = None
    ) -> SimResult:
        cfg = self.cfg
        self._push(cfg.sample_s, _SAMPLE, None)
        if self.lag:
            for n in self.nodes:
                n.report = n.memory_report(0.0)
            self._push(cfg.report_lag_s, _SCRAPE, None)
        heap = self.heap
        arrivals = iter(requests)
        nxt = next(arrivals, None)
        next_series = cfg.series_s
        while True:
            t_arr = nxt.arrival_s if nxt is not None else float("inf")
            t_evt = heap[0][0] if heap else float("inf")
            now = min(t_arr, t_evt)
            if now > duration_s:
                break
            if t_arr <= t_evt and nxt is not None:
                self._arrive(
                    nxt.prompt_tokens + nxt.output_tokens,
                    nxt,
                    now,
                    frozenset(),
                    cfg.client_retries,
                    True,
                )
                nxt = next(arrivals, None)
            else:
                _, _, kind, payload = heapq.heappop(heap)
                if kind == _COMPLETE:
                    self._complete(payload, now)
                elif kind == _SAMPLE:
                    self._sample(now)
                    if now >= next_series:
                        self._series(now)
                        next_series += cfg.series_s
                    if progress is not None:
                        progress(now)
                    self._push(now + cfg.sample_s, _SAMPLE, None)
                elif kind == _RETRY:
                    demand, req, exclude, left = payload
                    self.res.client_retries += 1
                    self._arrive(demand, req, now, exclude, left, False)
                elif kind == _EXPIRE:
                    self._expire(payload, now)
                elif kind == _RESTART_UP:
                    self._restart_done(payload, now)
                elif kind == _SCRAPE:
                    for n in self.nodes:
                        n.report = n.memory_report(now)
                        n.pending.clear()
                        n.view = None
                    self._push(now + cfg.report_lag_s, _SCRAPE, None)
        self.res.duration_s = duration_s
        if progress is not None:
            progress(duration_s)
        return self.res

    # --- the fleet as the gateway sees it ---------------------------------------------------
    def _view(self, n: _Node, now: float) -> NodeView:
        ceiling = n.ceiling if n.ceiling is not None and now < n.ceiling_until else None
        if self.lag:
            report = n.report
            pending = sum(n.pending.values())
        else:
            report = n.memory_report(now)
            pending = 0
        if (
            ceiling is not None
            and report is not None
            and report.reported_at > n.ceiling_set
            and report.largest_free_block_tokens >= ceiling
        ):
            ceiling = None  # a newer report shows a big enough block again (as the store does)
        ov = Overlay(
            pending_tokens=pending,
            inflight=n.inflight,
            draining=n.draining,
            ceiling_tokens=ceiling,
            ceiling_until=n.ceiling_until if ceiling is not None else 0.0,
        )
        view = NodeView(
            name=n.name,
            role="long" if n.role == "long" else "general",
            up=not n.down,
            report=report,
            overlay=ov,
        )
        n.view = view
        return view

    def _snapshot(self, now: float) -> FleetSnapshot:
        # Views are rebuilt when their node changed, and all of them every half staleness
        # period (so that a fresh report never looks stale to the policy).
        if now - self.snap_at >= self.refresh_s:
            for n in self.nodes:
                n.view = None
            self.snap_at = now
        return FleetSnapshot(
            nodes=tuple([n.view or self._view(n, now) for n in self.nodes]), taken_at=now
        )

    def _fleet_free_fraction(self) -> float:
        cap = free = 0
        for n in self.nodes:
            if not n.down:
                cap += n.alloc.capacity_tokens
                free += n.alloc.free_tokens
        return free / cap if cap else 0.0

    # --- requests ---------------------------------------------------------------------------
    def _candidates(self, demand: int, now: float, exclude: frozenset[str]) -> list[str]:
        if self.oracle:
            ok = [
                n
                for n in self.nodes
                if not n.down
                and not n.draining
                and n.name not in exclude
                and n.alloc.free_tokens >= demand
            ]
            ok.sort(key=lambda n: (-n.alloc.free_tokens, n.name))
            return [n.name for n in ok[:1]]
        assert self.policy is not None
        cls = classify(demand, self.cfg.settings.long_threshold_tokens)
        return self.policy.rank(self._snapshot(now), RouteRequest(demand, cls, exclude), now)

    def _arrive(
        self,
        demand: int,
        req: ReqLike,
        now: float,
        exclude: frozenset[str],
        retries_left: int,
        first: bool,
    ) -> None:
        res = self.res
        if first:
            res.requests += 1
            self.bucket_req += 1
            if req.kind == "long":
                res.long_requests += 1
        self._dispatch(_Pending(demand, req, exclude, retries_left), now)

    def _dispatch(self, w: _Pending, now: float) -> None:
        """The gateway's loop: rank, attempt the best, on failure exclude it and rank again;
        with nothing ranked, wait in the admission queue (bounded) for memory to free up."""
        cfg, res = self.cfg, self.res
        demand = w.demand
        while w.attempts < cfg.max_attempts:
            cands = self._candidates(demand, now, w.exclude | w.failed if w.failed else w.exclude)
            if not cands:
                self._queue(w, now)
                return
            name = cands[0]
            n = self.by_name[name]
            w.attempts += 1
            if cfg.max_concurrency and n.inflight >= cfg.max_concurrency:
                res.busy_attempts += 1
                w.failed.add(name)
                continue
            rid = self.rid
            self.rid += 1
            if n.alloc.allocate(rid, demand) is not None:
                self._placed(n, rid, demand, w.req, now)
                if w.queued_at is not None:
                    res.queue_wait_s += now - w.queued_at
                    res.queue_served += 1
                return
            res.failed_attempts += 1
            if n.alloc.free_tokens > HIGH_FREE * n.alloc.capacity_tokens:
                res.attempts_high_free += 1
            if n.ceiling is None or now >= n.ceiling_until or demand < n.ceiling:
                n.ceiling = demand
            n.ceiling_set = now
            n.ceiling_until = now + cfg.ceiling_ttl_s
            n.view = None
            w.failed.add(name)
        self._give_up(w, now)

    def _queue(self, w: _Pending, now: float) -> None:
        cfg = self.cfg
        if w.deadline is None:
            w.deadline = now + cfg.queue_wait_s
            w.queued_at = now
        if now >= w.deadline or len(self.waiting) >= cfg.queue_max:
            self._give_up(w, now)
            return
        self.qid += 1
        self.waiting[self.qid] = w
        if w.queued_at == now:
            self.res.queued += 1
        self._push(w.deadline, _EXPIRE, self.qid)

    def _expire(self, qid: int, now: float) -> None:
        w = self.waiting.pop(qid, None)
        if w is not None:
            self._give_up(w, now)

    def _wake(self, n: _Node, now: float) -> None:
        """Memory freed on ``n``: waiting requests it might now hold get another go (FIFO)."""
        if not self.waiting or n.down or n.draining:
            return
        room = n.alloc.largest_free_block_tokens
        for qid in [q for q, w in self.waiting.items() if w.demand <= room]:
            w = self.waiting.pop(qid, None)
            if w is not None:
                self._dispatch(w, now)

    def _give_up(self, w: _Pending, now: float) -> None:
        cfg, res = self.cfg, self.res
        res.gateway_failures += 1
        if w.retries_left > 0:
            # The client resends; kvroute's retry key keeps the nodes that failed it excluded.
            carry = (
                w.exclude | w.failed
                if self.policy is not None and self.policy.name == "kvroute"
                else frozenset()
            )
            self._push(
                now + cfg.client_retry_delay_s,
                _RETRY,
                (w.demand, w.req, frozenset(carry), w.retries_left - 1),
            )
            return
        res.failures += 1
        self.bucket_fail += 1
        if w.req.kind == "long":
            res.long_failures += 1
        if self._fleet_free_fraction() > HIGH_FREE:
            res.false_capacity_failures += 1

    def _placed(self, n: _Node, rid: int, demand: int, req: ReqLike, now: float) -> None:
        cfg = self.cfg
        n.inflight += 1
        n.live.add(rid)
        n.view = None
        if self.lag:
            n.pending[rid] = demand
        self.live_req[rid] = (n, demand)
        life = req.prompt_tokens / cfg.prefill_tps + req.output_tokens / cfg.decode_tps
        life += self.holds.extra(demand)
        self.res.served_tokens += demand
        self._push(now + life, _COMPLETE, rid)

    def _complete(self, rid: int, now: float) -> None:
        entry = self.live_req.pop(rid, None)
        if entry is None:
            return  # dropped by a restart
        n, _ = entry
        n.alloc.free(rid)
        n.inflight -= 1
        n.live.discard(rid)
        n.pending.pop(rid, None)
        n.view = None
        if n.draining and not n.live:
            self._go_down(n, now)
        else:
            self._wake(n, now)

    # --- sampling and restarts -----------------------------------------------------------------
    def _sample(self, now: float) -> None:
        res, cfg = self.res, self.cfg
        for n in self.nodes:
            if n.down:
                continue
            a = n.alloc
            frag = n.fragmentation()
            res.frag_sum += frag
            res.util_sum += 1.0 - a.free_tokens / a.capacity_tokens
            res.samples += 1
            if cfg.restart == "frag":
                hot = (
                    frag >= cfg.restart_frag
                    and a.free_tokens >= cfg.restart_min_free * a.capacity_tokens
                )
                if not hot:
                    n.frag_since = None
                elif n.frag_since is None:
                    n.frag_since = now
        self._maybe_restart(now)

    def _maybe_restart(self, now: float) -> None:
        cfg = self.cfg
        r = self.restarting
        if r is not None:
            if r.draining and now - r.drain_started >= cfg.drain_timeout_s:
                self._go_down(r, now)
            return
        pick: _Node | None = None
        if cfg.restart == "uptime":
            due = [
                n for n in self.nodes if not n.down and now - n.started_at >= cfg.restart_uptime_s
            ]
            pick = min(due, key=lambda n: n.started_at, default=None)
        elif cfg.restart == "frag":
            due = [
                n
                for n in self.nodes
                if n.frag_since is not None
                and now - n.frag_since >= cfg.restart_frag_for_s
                and now - n.started_at >= cfg.restart_min_interval_s
            ]
            pick = max(due, key=lambda n: n.fragmentation(), default=None)
        if pick is None:
            return
        self.restarting = pick
        pick.draining = True
        pick.drain_started = now
        pick.view = None
        if not pick.live:
            self._go_down(pick, now)

    def _go_down(self, n: _Node, now: float) -> None:
        for rid in list(n.live):
            self.live_req.pop(rid, None)
            self.res.evicted += 1
        n.live.clear()
        n.inflight = 0
        n.pending.clear()
        n.alloc.reset()
        n.down = True
        n.view = None
        self._push(now + self.cfg.restart_downtime_s, _RESTART_UP, n.name)

    def _restart_done(self, name: str, now: float) -> None:
        n = self.by_name[name]
        n.down = False
        n.draining = False
        n.started_at = now
        n.frag_since = None
        n.ceiling = None
        n.restarts += 1
        self.res.restarts += 1
        n.view = None
        if self.lag:
            n.report = n.memory_report(now)
        if self.restarting is n:
            self.restarting = None
        self._wake(n, now)

    def _series(self, now: float) -> None:
        res = self.res
        res.series_t.append(now)
        for n in self.nodes:
            a = n.alloc
            res.series_frag[n.name].append(0.0 if n.down else round(n.fragmentation(), 4))
            res.series_free[n.name].append(a.free_tokens)
            res.series_largest[n.name].append(a.largest_free_block_tokens)
            res.series_uptime[n.name].append(0.0 if n.down else now - n.started_at)
        res.series_failures.append(self.bucket_fail)
        res.series_requests.append(self.bucket_req)
        self.bucket_fail = 0
        self.bucket_req = 0


def simulate(
    cfg: SimConfig,
    policy: str,
    requests: Iterable[ReqLike],
    duration_s: float,
    progress: ProgressFn | None = None,
) -> SimResult:
    """Run one policy; ``requests`` must be sorted by arrival (a fresh iterator per call)."""
    return Simulation(cfg, policy).run(requests, duration_s, progress)


def with_nodes(cfg: SimConfig, nodes: int, long_pool_fraction: float | None = None) -> SimConfig:
    """The same config at another fleet size, the long pool scaled to keep its share."""
    frac = cfg.long_pool / cfg.nodes if long_pool_fraction is None else long_pool_fraction
    pool = min(nodes - 1, max(1, round(frac * nodes))) if frac > 0 and nodes > 1 else 0
    return replace(cfg, nodes=nodes, long_pool=pool)
