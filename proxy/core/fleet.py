"""The fleet as the router sees it: what each backend reported, plus the gateway's overlay.

Pure data, no I/O: the gateway builds a ``FleetSnapshot`` from the state store, the offline
simulator builds one from its allocator models, and the same policy code ranks both.
All sizes are in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proxy.core.lazy import lazy_headroom, projected_headroom

AllocatorKind = Literal["contiguous", "paged"]

# Why an allocation failed: the memory was there but broken up, or it was not there.
FailureCause = Literal["fragmentation", "capacity"]


def classify_failure(demand: int, free_tokens: int | None) -> FailureCause:
    """``fragmentation`` when the free memory would have held the demand, just not in one block."""
    return "fragmentation" if free_tokens is not None and free_tokens >= demand else "capacity"


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """A backend's KV-cache state as it last reported it (scraped or pushed)."""

    capacity_tokens: int
    free_tokens: int
    largest_free_block_tokens: int
    allocator: AllocatorKind = "contiguous"
    block_size: int = 1
    running: int = 0
    waiting: int = 0
    started_at: float = 0.0
    reported_at: float = 0.0
    # Cumulative preemptions (vLLM recomputes a running request when a decode step finds no
    # block); a rise between reports is the signal, not the level.
    preemptions: int = 0
    # Data parallel: engines behind this one URL, and each engine's free tokens. The server
    # picks the engine (by queue length, not KV), so a request fits only if it fits the
    # engine with the least room: ``largest_free_block_tokens`` is that engine's figure.
    engines: int = 1
    engine_free_tokens: tuple[int, ...] = ()
    max_num_seqs: int = 0  # 0: not known
    # The server queues work it cannot place and allocates KV as prefill and decode proceed
    # (vLLM, SGLang, TGI), instead of failing at admission (kvroute's contiguous engine).
    queueing: bool = False
    sleeping: bool = False  # vLLM sleep mode: near-zero usage that must not look empty
    # Cumulative prompt tokens prefilled and seconds spent prefilling them, summed over the
    # server's engines (vLLM's per-request histograms' sums); 0 when not exported. The rate
    # is learned from their rise between reports (``proxy.routing.prefill_rate``).
    prefill_tokens: float = 0.0
    prefill_seconds: float = 0.0
    # The server shows a request only some time after it was sent (llama.cpp's /slots: once
    # the server has read it and its loop has taken it, seconds on a loaded CPU), and
    # overfilling it fails every request in flight (llama.cpp's unified KV pool). Besides the
    # contiguous rule, every live reservation then counts against it at its full demand.
    counts_flights: bool = False
    # The largest request the server takes into its own queue when it has no room for it now,
    # and starts as soon as room frees, never refusing it for room (llama.cpp's partitioned
    # slots: one slot's ``n_ctx``; every busy slot defers a new request, and any slot holds
    # it); 0: none, the server takes only what has room now (a unified pool overfilled fails
    # every request in flight).
    queued_up_to_tokens: int = 0

    def whole_blocks(self, tokens: float) -> float:
        """``tokens`` rounded up to whole blocks where the allocator hands out blocks (paged)."""
        if self.allocator == "paged" and self.block_size > 1:
            return float(-(-int(tokens) // self.block_size) * self.block_size)
        return tokens

    @property
    def free_fraction(self) -> float:
        return self.free_tokens / self.capacity_tokens if self.capacity_tokens > 0 else 0.0

    @property
    def largest_block_ratio(self) -> float:
        """largest_contiguous_free_block_ratio: largest free block / total free (1.0 when nothing is free)."""
        if self.free_tokens <= 0:
            return 1.0
        return min(1.0, self.largest_free_block_tokens / self.free_tokens)

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / total free: 0 for a fresh allocator, towards 1 when checkerboarded."""
        return 1.0 - self.largest_block_ratio

    def uptime(self, now: float) -> float:
        return max(0.0, now - self.started_at) if self.started_at > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Overlay:
    """What the gateway knows that the backend's report does not (yet) show."""

    pending_tokens: int = 0  # reservations made after the report: not yet visible in it
    reserved_tokens: int = 0  # all live reservations (for metrics)
    inflight: int = 0  # live reservations count
    draining: bool = False
    cooldown_until: float = 0.0
    ceiling_tokens: int | None = None  # learned: a request of this size or more failed here
    ceiling_until: float = 0.0
    # Why the node is full for new work whatever its KV says (proxy.core.pressure):
    # "queue", "slots", "preemption", "asleep"; empty when it may take work.
    pressure: str = ""
    # Lazily allocating servers: KV the in-flight work will hold at its projected peak, per
    # engine, with this request's unused output discounted (``proxy.core.projection``, set
    # per request by ``proxy.gateway.pressure``); None: every reservation at full demand.
    projected_tokens: int | None = None
    # Data-parallel servers whose engine the gateway pins (``X-data-parallel-rank``): the
    # engine this request would go to, chosen with the projection; None: the server picks.
    engine: int | None = None

    def plus_pending(self, tokens: int, count: int, pending: int | None = None) -> Overlay:
        """With ``count`` more reservations (``tokens`` in all) that the report cannot show yet.

        ``pending``: of those tokens, what counts as pending where it differs (reservations
        released since the view was read are taken out with negative figures, only the
        ones made after the report as pending: ``proxy.gateway.local_view``).
        Field by field, not ``dataclasses.replace`` (done per node per request: measured
        2x faster); a test checks it keeps every other field.
        """
        return Overlay(
            self.pending_tokens + (tokens if pending is None else pending),
            self.reserved_tokens + tokens,
            self.inflight + count,
            self.draining,
            self.cooldown_until,
            self.ceiling_tokens,
            self.ceiling_until,
            self.pressure,
            self.projected_tokens,
            self.engine,
        )


@dataclass(frozen=True, slots=True)
class NodeView:
    """One backend as the policy sees it."""

    name: str
    pool: str = "general"
    role: Literal["general", "long"] = "general"
    up: bool = True
    report: MemoryReport | None = None
    overlay: Overlay = field(default_factory=Overlay)

    def with_overlay(self, overlay: Overlay) -> NodeView:
        """This node with another overlay (field by field, see ``Overlay.plus_pending``)."""
        return NodeView(self.name, self.pool, self.role, self.up, self.report, overlay)

    def stale(self, now: float, stale_after_s: float) -> bool:
        return self.report is None or now - self.report.reported_at > stale_after_s

    def usable_free(self) -> int:
        """Free memory by its report less pending reservations (never below 0; 0 without a report)."""
        if self.report is None:
            return 0
        return max(0, self.report.free_tokens - self.overlay.pending_tokens)

    def usable_block(self) -> int:
        """The largest request this node can take now.

        Contiguous (allocates at admission): its report less the reservations newer than it.
        Lazily allocating servers (``report.queueing``): every live reservation counts at
        its full demand (``proxy.core.lazy``), since their reports show only what is
        already cached; where the memory-pressure projection is laid over the view, at its
        projected peak with the unexplained usage added (``projected_headroom``).
        """
        if self.report is None:
            return 0
        if self.report.queueing:
            projected = self.overlay.projected_tokens
            if projected is not None:
                return projected_headroom(self.report, projected, self.overlay.engine)
            return lazy_headroom(self.report, self.overlay.reserved_tokens)
        block = max(0, self.report.largest_free_block_tokens - self.overlay.pending_tokens)
        if self.report.counts_flights:
            # What the gateway has in flight there, whether the report shows it yet or not.
            return min(block, lazy_headroom(self.report, self.overlay.reserved_tokens))
        return block

    def queued_block(self) -> int:
        """The largest request this node's server queues when it has no room now (0: none)."""
        return self.report.queued_up_to_tokens if self.report is not None else 0

    def ceiling_active(self, now: float) -> bool:
        return self.overlay.ceiling_tokens is not None and now < self.overlay.ceiling_until

    def _need(self, demand: int, now: float, safety_margin: float) -> float | None:
        """The room ``demand`` takes here (margin, whole blocks); None: refused whatever the room
        (a learned ceiling, or the node full for new work)."""
        if self.ceiling_active(now) and demand >= (self.overlay.ceiling_tokens or 0):
            return None
        if self.overlay.pressure:
            return None
        need = demand * (1.0 + safety_margin)
        if self.report is not None:
            need = self.report.whole_blocks(need)
        return need

    def fits_now(self, demand: int, now: float, safety_margin: float = 0.0) -> bool:
        """Room for ``demand`` now (``usable_block``)."""
        need = self._need(demand, now, safety_margin)
        return need is not None and need <= self.usable_block()

    def fits(self, demand: int, now: float, safety_margin: float = 0.0) -> bool:
        """The node takes ``demand``: room now, or a server that queues it (``queued_block``)
        rather than refusing it."""
        need = self._need(demand, now, safety_margin)
        return need is not None and (need <= self.queued_block() or need <= self.usable_block())


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    nodes: tuple[NodeView, ...]
    taken_at: float = 0.0

    def by_name(self) -> dict[str, NodeView]:
        return {n.name: n for n in self.nodes}

    def total_free(self) -> int:
        return sum(n.report.free_tokens for n in self.nodes if n.report is not None and n.up)

    def total_capacity(self) -> int:
        return sum(n.report.capacity_tokens for n in self.nodes if n.report is not None and n.up)
