"""The gateway's side of memory pressure on lazily allocating engines (docs/memory-pressure.md).

Keeps, per backend, the requests this replica has in flight there with their progress
(output events relayed), learns how much of ``max_tokens`` requests really write, and lays
each node's projected peak (``proxy.core.projection``) over the fleet view a request ranks
on. A rising preemption counter tightens that node's budget
(``proxy.core.preemption_headroom``); held requests keep their place in line within a bound
(``proxy.core.aging``).

Hooks, one call each: ``apply`` (ranking), ``placed`` / ``not_placed`` (end of placement),
``progress`` (each relayed chunk), ``finished`` (a stream that ended well), ``answered`` (a
whole JSON answer), ``ended`` (the reservation's release).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from proxy.config import Config
from proxy.core.aging import HeldOrder
from proxy.core.answer_usage import answer_usage
from proxy.core.ended_flights import EndedFlights
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.preemption_headroom import HeadroomSettings, PreemptionHeadroom
from proxy.core.projection import (
    Flight,
    OutputRatios,
    busiest_engine_peak,
    choose_engine,
    projected_peak,
    steps_until_free,
)
from proxy.core.stream_progress import CharsPerToken, StreamCount
from proxy.routing.decode_rate import DecodeRates
from proxy.upstream.client import header

if TYPE_CHECKING:
    from proxy.gateway.context import RequestContext


def client_key(ctx: RequestContext) -> str | None:
    """A short hash of the client's credential (never the credential itself); None without one."""
    auth = header(ctx.request.headers, "authorization")
    if not auth:
        return None
    return "client:" + hashlib.blake2b(auth.encode(), digest_size=6).hexdigest()


class MemoryPressure:
    """Flights per backend, learned output ratios, per-node budgets, the held line."""

    def __init__(
        self, cfg: Config, registry: CollectorRegistry, clock: Callable[[], float] | None = None
    ) -> None:
        mp = cfg.memory_pressure
        # Flights ended since a node's report (``proxy.core.ended_flights``), on ``clock``, the
        # store's (reports are stamped with it); without one, none are kept.
        self.clock = clock
        self.freed = EndedFlights()
        self.enabled = mp.enabled
        self.per_client = mp.per_client
        self.max_hold_s = mp.max_hold_s
        self.ratios = OutputRatios(mp.output_quantile, mp.min_samples, mp.window)
        self.headroom = PreemptionHeadroom(
            HeadroomSettings(mp.preemption_step, mp.preemption_floor, mp.preemption_relax_s)
        )
        self.order = HeldOrder(mp.max_overtakes)
        # Each backend's decode rate as its streams show it (bounds the drain a hold waits for).
        self.decode = DecodeRates()
        self.flights: dict[str, dict[str, Flight]] = {}
        # Per reservation id: what its stream has carried (events, characters).
        self.counts: dict[str, StreamCount] = {}
        self.chars_per_token = CharsPerToken()
        self.budget_gauge = Gauge(
            "kvroute_kv_budget_fraction",
            "Fraction of a lazily allocating node's KV the projection may fill (preemptions lower it)",
            ["backend"],
            registry=registry,
        )
        held = Gauge(
            "kvroute_held_at_overtake_limit",
            "Requests held at the gateway that newer requests may no longer overtake",
            registry=registry,
        )
        held.set_function(self.order.starving)
        self._shown: dict[str, float] = {}
        # Backends whose data-parallel engine the server's front end picks (config
        # ``data_parallel_routing: server``); every other one is pinned by the gateway.
        self.unpinned: frozenset[str] = frozenset()
        # Per request: the engine each data-parallel node's projection chose for it (the
        # last ranking's), read when it is placed.
        self._chosen: dict[str, dict[str, int]] = {}
        self.reconfigure(cfg)

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed backend list: which backends the gateway pins engines on."""
        self.unpinned = frozenset(
            b.name for b in cfg.backends if b.data_parallel_routing == "server"
        )

    # ------------------------------------------------------------------ learning
    def keys(self, ctx: RequestContext) -> list[str]:
        """Where this request's output ratio is learned, most specific first.

        Its client and model, then its model; always within its request class. Chats and
        documents ask for output differently, and chats finish first: a model-wide ratio
        learned in the first seconds is the chats' (measured: 0.47 of ``max_tokens`` from 36
        chats and 8 documents, while documents wrote up to 0.89), and two documents placed
        on it outgrew one engine and preempted. Below ``min_samples`` for its class a request
        counts at ``max_tokens``.
        """
        if ctx.output_keys is not None:
            return ctx.output_keys
        model = f"model:{ctx.parsed.model}|{ctx.cls}"
        client = client_key(ctx) if self.per_client else None
        ctx.output_keys = [f"{client}|{model}", model] if client else [model]
        return ctx.output_keys

    def flight_for(self, ctx: RequestContext, project: bool = True) -> Flight:
        """The request as a flight: its expected output learned (``project``), else its max.

        The expected output is worked out once per request, by the ranking that projects it
        (``apply``), and placement reuses it. Where no ranking projected the request (no
        lazily allocating node in view: a contiguous server holds a request at its whole
        ``max_tokens``), placement records it at its max without looking anything up.
        """
        max_out = max(1, ctx.demand - ctx.prompt_tokens)
        memo = ctx.expected_output
        if memo is not None and memo[0] == max_out:
            return Flight(ctx.prompt_tokens, max_out, memo[1])
        if not project or not self.enabled:
            return Flight(ctx.prompt_tokens, max_out, max_out)
        expected = self.ratios.expected(self.keys(ctx), max_out)
        ctx.expected_output = (max_out, expected)
        return Flight(ctx.prompt_tokens, max_out, expected)

    # ------------------------------------------------------------------ ranking
    def apply(self, view: FleetSnapshot, ctx: RequestContext, now: float) -> FleetSnapshot:
        """``view`` with each lazily allocating node's projected peak set (a per-request view)."""
        if not self.enabled:
            return view
        new: Flight | None = None
        nodes: list[NodeView] = []
        for n in view.nodes:
            r = n.report
            if r is not None and r.queueing:
                if new is None:
                    new = self.flight_for(ctx)
                n = self._project(n, r, new, ctx, now)
            nodes.append(n)
        # No lazily allocating node (a contiguous fleet): the view as it was, nothing built.
        return view if new is None else FleetSnapshot(tuple(nodes), taken_at=view.taken_at)

    def _project(
        self, n: NodeView, r: MemoryReport, new: Flight, ctx: RequestContext, now: float
    ) -> NodeView:
        """``n`` (whose report ``r`` says it allocates lazily) with ``new``'s projected peak."""
        budget = self.headroom.observe(n.name, r.preemptions, now)
        if self._shown.get(n.name) != budget:
            self._shown[n.name] = budget
            self.budget_gauge.labels(n.name).set(budget)
        mine = self.flights.get(n.name, {})
        others = [f for rid, f in mine.items() if rid != ctx.reservation_id]
        engines = max(1, r.engines)
        alone = projected_peak(others, r.block_size)
        marginal = projected_peak([*others, new], r.block_size) - alone
        foreign = self._foreign(n)
        spare = (1.0 - budget) * r.capacity_tokens / engines
        per_engine = alone / engines
        engine: int | None = None
        if engines > 1 and len(r.engine_free_tokens) == engines:
            capacity = r.capacity_tokens // engines
            used = [capacity - free for free in r.engine_free_tokens]
            if n.name not in self.unpinned:
                choice = choose_engine(
                    others, new, used, capacity, r.block_size, foreign / engines + spare
                )
                engine = choice.engine
                self._chosen.setdefault(ctx.reservation_id, {})[n.name] = engine
                return self._with_projection(n, max(0, choice.committed - ctx.demand), engine)
            held = sum(f.now_tokens for f in others)
            per_engine = busiest_engine_peak(used, held, alone)
        else:
            # Usage its flights do not explain (other clients, work ended since the report)
            # stays: the peak is on top of it (``proxy.core.lazy.projected_headroom``).
            used_now = r.capacity_tokens - r.free_tokens - self.freed.since(n.name, r.reported_at)
            per_engine += max(0, used_now - sum(f.now_tokens for f in others)) / engines
        committed = per_engine + foreign / engines + marginal + spare
        return self._with_projection(n, max(0, math.ceil(committed) - ctx.demand), engine)

    def decided_here(self, view: FleetSnapshot, ranked: Iterable[str]) -> frozenset[str]:
        """Of ``ranked``, the nodes where this projection decides the fit, not the store.

        The store's atomic reserve checks a lazily allocating node with every live
        reservation at its full demand (``proxy.state.base.reservation_fits``), the rule
        without projection: it refused what the ranking had just found to fit on its
        projected peak, and the request moved to a worse node or held (measured on the
        disaggregation benchmark: a document held 5.5 s; docs/benchmarks.md, section 10).
        Where every reservation on the node is this replica's, its flights are the whole
        truth and the projection decides alone. Where another replica holds one there,
        the store's check stays: it is what keeps two replicas from taking the same room at
        once.
        """
        if not self.enabled:
            return frozenset()
        wanted = set(ranked)
        out: set[str] = set()
        for n in view.nodes:
            if n.name not in wanted or n.overlay.projected_tokens is None:
                continue
            if self._foreign(n) == 0:
                out.add(n.name)
        return frozenset(out)

    def _foreign(self, n: NodeView) -> int:
        """Tokens reserved on ``n`` that this replica does not hold (other gateway replicas'
        requests, at full demand): what its flights cannot project."""
        own_full = sum(
            f.prompt_tokens + f.max_tokens for f in self.flights.get(n.name, {}).values()
        )
        return max(0, n.overlay.reserved_tokens - own_full)

    @staticmethod
    def _with_projection(n: NodeView, projected: int, engine: int | None) -> NodeView:
        ov = n.overlay
        return n.with_overlay(
            Overlay(
                ov.pending_tokens,
                ov.reserved_tokens,
                ov.inflight,
                ov.draining,
                ov.cooldown_until,
                ov.ceiling_tokens,
                ov.ceiling_until,
                ov.pressure,
                projected,
                engine,
            )
        )

    def hand_over(
        self, ctx: RequestContext, best: NodeView, held_s: float, wait_s: float, rate: float
    ) -> bool:
        """Should a request held for ``best`` (short of projected KV) join its queue now?

        Sent now, the engine admits it as soon as its prompt fits and preempts someone when
        the decodes grow into each other: a recompute and a stall. Held, it starts once this
        replica's flights there have freed the room, at a time the projection knows
        (``steps_until_free`` at the backend's decode rate). So it is held while that time
        falls within ``max_hold_s``; when the room is not expected by then, or the flights
        here can never free it (other clients' load), the rule without projection applies:
        hold as long as the backend's expected wait (ski rental), then join.
        """
        if not self.enabled or best.report is None or not best.report.queueing:
            return held_s >= wait_s
        deficit = ctx.demand - best.usable_block()
        flights: Iterable[Flight] = self.flights.get(best.name, {}).values()
        engine = best.overlay.engine
        if engine is not None:
            # Pinned to one engine: only what ends there frees its room.
            flights = [f for f in flights if f.engine in (engine, None)]
        steps = steps_until_free(flights, deficit)
        drain_s = steps / max(rate, 1e-9)
        if math.isinf(drain_s) or held_s + drain_s > self.max_hold_s:
            return held_s >= wait_s
        return False

    # ------------------------------------------------------------------ request life
    def placed(self, ctx: RequestContext, backend: str) -> None:
        self.order.placed(ctx.reservation_id)
        if ctx.hold_started is not None and ctx.held_s is None:
            # The answer's ``Server-Timing: hold`` (the first placement ends the hold).
            ctx.held_s = time.monotonic() - ctx.hold_started
        flight = self.flight_for(ctx, project=False)
        flight.engine = self._chosen.pop(ctx.reservation_id, {}).get(backend)
        self.flights.setdefault(backend, {})[ctx.reservation_id] = flight

    def not_placed(self, ctx: RequestContext) -> None:
        self.order.gone(ctx.reservation_id)
        self._chosen.pop(ctx.reservation_id, None)

    def forget(self, ctx: RequestContext) -> None:
        """The request's walk ended: drop the engine choices of rankings never placed."""
        self._chosen.pop(ctx.reservation_id, None)

    def engine_of(self, ctx: RequestContext, backend: str) -> int | None:
        """The data-parallel engine this request is pinned to on ``backend`` (None: the
        server picks): sent as ``X-data-parallel-rank``."""
        flight = self.flights.get(backend, {}).get(ctx.reservation_id)
        return flight.engine if flight is not None else None

    def progress(self, ctx: RequestContext, backend: str, chunk: bytes) -> None:
        """One relayed chunk: the flight has written what the stream carried so far."""
        flight = self.flights.get(backend, {}).get(ctx.reservation_id)
        if flight is None:
            return
        count = self.counts.get(ctx.reservation_id)
        if count is None:
            count = self.counts[ctx.reservation_id] = StreamCount()
        count.add(chunk)
        cpt = self.chars_per_token.get(ctx.parsed.model)
        flight.generated = count.tokens(cpt, flight.max_tokens)

    def finished(self, ctx: RequestContext, backend: str) -> None:
        """A stream ended well: learn its output / max_tokens (and characters per token)."""
        flight = self.flights.get(backend, {}).get(ctx.reservation_id)
        count = self.counts.get(ctx.reservation_id)
        if flight is None or count is None:
            return
        if count.at_length:
            self.chars_per_token.observe(ctx.parsed.model, count.chars, flight.max_tokens)
        if ctx.first_event_at is not None:
            elapsed = asyncio.get_running_loop().time() - ctx.first_event_at
            self.decode.observe(backend, flight.generated, elapsed)
        for key in self.keys(ctx):
            self.ratios.observe(key, flight.generated, flight.max_tokens)

    def answered(self, ctx: RequestContext, backend: str, answer: Mapping[str, Any]) -> None:
        """A whole JSON answer: learn its output / max_tokens from the server's own count.

        Clients that do not stream would otherwise be projected at ``max_tokens`` for ever.
        """
        flight = self.flights.get(backend, {}).get(ctx.reservation_id)
        if flight is None:
            return
        usage = answer_usage(answer)
        if usage is None:
            return
        written = flight.max_tokens if usage.at_length else usage.completion_tokens
        flight.generated = min(flight.max_tokens, written)
        if not ctx.counts_request:
            # Step 1 of a two-step request: one token by design, nothing about what its class
            # writes (as samples its 1/1 ratios outnumbered the class's real ones).
            return
        self.chars_per_token.observe(ctx.parsed.model, usage.chars, usage.completion_tokens)
        for key in self.keys(ctx):
            self.ratios.observe(key, flight.generated, flight.max_tokens)

    def recounted(self, ctx: RequestContext, backend: str) -> None:
        """Its exact count arrived after it was placed on a bound: project its real prompt."""
        flight = self.flights.get(backend, {}).get(ctx.reservation_id)
        if flight is not None:
            flight.prompt_tokens = min(flight.prompt_tokens, ctx.prompt_tokens)

    def ended(self, ctx: RequestContext, backend: str) -> None:
        self.counts.pop(ctx.reservation_id, None)
        held = self.flights.get(backend)
        if held is not None:
            flight = held.pop(ctx.reservation_id, None)
            if flight is not None and flight.generated and ctx.counts_request and self.clock:
                # It ran (it wrote), so the server held its blocks until now; step 1's stay
                # on its prefill server until the decode server pulls them.
                self.freed.ended(backend, self.clock(), flight.now_tokens)
            if not held:
                del self.flights[backend]

    # ------------------------------------------------------------------ views
    def node_json(self, name: str) -> dict[str, object]:
        """The node's part in ``GET /fleet``: budget, preemption rises, projected peak."""
        node = self.headroom.nodes.get(name)
        flights = list(self.flights.get(name, {}).values())
        out: dict[str, object] = {
            "kv_budget_fraction": round(self.headroom.budget(name), 3),
            "preemption_rises": node.rises if node is not None else 0,
            "inflight_tracked": len(flights),
            "projected_peak_tokens": projected_peak(flights),
            "data_parallel_routing": "server" if name in self.unpinned else "gateway",
        }
        pinned = [f.engine for f in flights if f.engine is not None]
        if pinned:
            # Data parallel, engines pinned by the gateway: its flights on each engine.
            counts = [0] * (max(pinned) + 1)
            for e in pinned:
                counts[e] += 1
            out["inflight_per_engine"] = counts
        return out

    def annotate(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add each lazily allocating backend's projection to its ``GET /fleet`` item."""
        for item in items:
            report = item.get("report")
            if isinstance(report, dict) and report.get("queueing"):
                item["memory_pressure"] = self.node_json(item["name"])
        return items

    def learned_json(self) -> dict[str, object]:
        return {
            key: {"ratio": self.ratios.ratio(key), "samples": self.ratios.samples(key)}
            for key in self.ratios.keys()
        }
