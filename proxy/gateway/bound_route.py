"""Route a big new prompt on its proven upper bound while its exact count finishes.

A 220 KB document the gateway has not seen costs 15-25 ms of CPU to encode exactly; a
client sending it alone waited that long before its request left (measured: +24 ms end to
end for a new 30k-token prompt on the shared 2-core box). When bounds on the count already
decide everything the route depends on, waiting for the exact count changes nothing, so the
request is routed now on the upper bound (``proxy.core.size_bounds``) and counted exactly in
a sizing thread meanwhile. Routed on the bound only when all of these hold:

* much of it is new (sizing from the caches on the loop would have to encode more than
  ``routing.tokenize_in_thread_chars`` bytes), its tokenizer is one the bounds are proven
  for, ``sizing.route_on_bound`` is on and no backend takes prefill steps only;
* the class is the same at both bounds (short/long against ``routing.long_threshold_tokens``);
* the upper bound passes the length checks (the model's ``max_model_len``, the largest
  cache) and leaves no backend too small for it;
* every backend with a report that is not ruled out fits the upper bound (so the set of
  nodes that fit, and with it the ranking, is what the exact count would give);
* with prefix affinity on, the prompt's new text starts within its first
  ``routing.prefix.min_saving_tokens`` bytes: no backend can hold a prefix worth routing for.

At most ``PENDING_PER_THREAD`` exact counts per sizing thread run behind requests already
routed; past that a request waits for its own count, as before. Without that cap, new
documents arriving faster than the sizing threads encode them (64 unique 220 KB prompts at
150 connections) would queue counts without end, each holding its body.

What the bound changes: the reservation holds the upper bound (never less than it needs)
until the exact count arrives, a sizing thread's encode later (~15-25 ms for 220 KB). Then
the request's demand and its reservation shrink to the exact size (``StateStore.shrink``;
a shrink after the release changes nothing), the count is the one compared with the
server's usage (``proxy.gateway.token_counts``), and the prompt's block hashes are recorded
for the backend chosen (later requests find the prefix). ``x-kvroute-demand-tokens`` shows
the demand when the answer's headers were written: the bound if the count was still running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from proxy.config import Config
from proxy.core.catalog import Catalog, ModelRoute
from proxy.core.chunk_count import EncodeJob
from proxy.core.chunked_counter import ChunkedCounter
from proxy.core.demand import Demand, Sizer
from proxy.core.fleet import FleetSnapshot
from proxy.core.size_bounds import DemandBounds, demand_bounds, new_within
from proxy.core.two_step import prefill_only
from proxy.core.validation import ParsedRequest
from proxy.errors import ApiError
from proxy.gateway import sizing
from proxy.gateway.affinity import Affinity, AffinityKey
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.local_view import LocalReservations
from proxy.gateway.memory_pressure import MemoryPressure
from proxy.gateway.models import check_length
from proxy.gateway.token_counts import TokenCounts
from proxy.routing.policy import Policy, classify
from proxy.state.fleet_cache import FleetCache

if TYPE_CHECKING:
    from proxy.gateway.context import RequestContext


class BoundPorts(Protocol):
    """What routing on a bound uses: the fleet view, the token-count corrections, affinity
    (where the blocks go once counted), the clock placements are recorded by, and the
    reservation's three keepers (the store's ledger, this replica's view, the projection)
    that the exact count shrinks."""

    fleet: FleetCache
    token_counts: TokenCounts
    affinity: Affinity
    clock: Callable[[], float]
    ledger: ReservationLedger
    local: LocalReservations
    pressure: MemoryPressure


log = logging.getLogger("kvroute.gateway")

#: Exact counts still running behind requests routed on their bound, per sizing thread.
PENDING_PER_THREAD = 4
_pending = 0


@dataclass(slots=True)
class Bound:
    """A request routed on ``upper`` while ``exact`` counts it."""

    upper: Demand
    exact: asyncio.Task[Demand]


async def size_or_bound(
    gw: BoundPorts,
    parsed: ParsedRequest,
    cfg: Config,
    policy: Policy,
    served: ModelRoute,
    catalog: Catalog,
) -> Demand | Bound:
    """The exact demand, or a ``Bound`` to route on when the exact count cannot change the route."""
    sizer = sizing.loaded(cfg)
    inline = cfg.routing.tokenize_in_thread_chars
    chars = sizing.chars_to_count(sizer, parsed, inline) if sizer is not None else None
    if not _may_bound(cfg, parsed, sizer, chars):
        return await sizing.size_request(parsed, cfg, served.limit, chars=chars)
    cached = sizing.size_from_caches(parsed, cfg, served.limit)
    if not isinstance(cached, EncodeJob):
        return (
            cached
            if cached is not None
            else await sizing.size_request(parsed, cfg, served.limit, chars=chars)
        )
    job = cached
    sizer = sizing.sizer_for(cfg)
    counter = sizer.model(parsed.model).counter
    bounds = demand_bounds(sizer, parsed, served.limit)
    unworthy = cfg.routing.prefix.min_saving_tokens
    if (
        bounds is None
        or not isinstance(counter, ChunkedCounter)
        or (cfg.routing.prefix.enabled and not new_within(counter, parsed.body, unworthy))
    ):
        return await sizing.size_request(parsed, cfg, served.limit, job)
    snap = await gw.fleet.snapshot()
    if not _decides(gw, cfg, policy, served, catalog, parsed, bounds, snap):
        return await sizing.size_request(parsed, cfg, served.limit, job)
    sizing.SIZED_WHERE["bound"] += 1
    upper = _corrected(gw, parsed, bounds.upper)
    return Bound(upper, _count_behind(parsed, cfg, served.limit, job))


def _count_behind(
    parsed: ParsedRequest, cfg: Config, limit: int | None, job: EncodeJob
) -> asyncio.Task[Demand]:
    """The exact count as a task, counted in ``_pending`` until it ends."""
    global _pending
    _pending += 1

    def ended(_: asyncio.Task[Demand]) -> None:
        global _pending
        _pending -= 1

    task = asyncio.ensure_future(sizing.size_request(parsed, cfg, limit, job))
    task.add_done_callback(ended)
    return task


def pending() -> int:
    """Exact counts running behind requests already routed (``PENDING_PER_THREAD`` bounds them)."""
    return _pending


def _may_bound(cfg: Config, parsed: ParsedRequest, sizer: Sizer | None, chars: int | None) -> bool:
    """Whether ``parsed`` (``chars`` to count, as ``sizer`` sees them) may route on a bound."""
    if sizer is None or chars is None or chars <= cfg.routing.tokenize_in_thread_chars:
        return False
    if not cfg.sizing.route_on_bound or prefill_only(cfg.backends):
        return False
    if _pending >= PENDING_PER_THREAD * cfg.sizing.threads:
        return False
    return isinstance(sizer.model(parsed.model).counter, ChunkedCounter)


def _corrected(gw: BoundPorts, parsed: ParsedRequest, d: Demand) -> Demand:
    """``d`` with the learned tokenizer correction applied to its prompt, as intake applies it."""
    return Demand(gw.token_counts.correct(parsed.model, d.prompt_tokens), d.max_new_tokens)


def _decides(
    gw: BoundPorts,
    cfg: Config,
    policy: Policy,
    served: ModelRoute,
    catalog: Catalog,
    parsed: ParsedRequest,
    bounds: DemandBounds,
    snap: FleetSnapshot,
) -> bool:
    """True when the exact count, anywhere between the bounds, would route the same way."""
    rcfg = cfg.routing
    low, high = _corrected(gw, parsed, bounds.lower), _corrected(gw, parsed, bounds.upper)
    threshold = rcfg.long_threshold_tokens
    if classify(low.total, threshold) != classify(high.total, threshold):
        return False
    try:
        if check_length(catalog, served, parsed, high.prompt_tokens):
            return False
    except ApiError:
        return False
    margin = rcfg.safety_margin if policy.checks_fit else 0.0
    now = gw.clock()
    reporting = [n for n in snap.nodes if n.report is not None and n.name not in served.ruled_out]
    if not reporting:
        return False
    if served.limit is None and high.total * (1.0 + margin) > max(
        n.report.capacity_tokens for n in reporting if n.report is not None
    ):
        return False
    return all(n.fits(high.total, now, margin) for n in reporting)


def attach(gw: BoundPorts, ctx: RequestContext, bound: Bound) -> None:
    """When the exact count arrives: it is the count compared with usage; record the prompt's blocks."""

    def done(task: asyncio.Task[Demand]) -> None:
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            log.warning("exact count of a request routed on its bound failed: %r", err)
            return
        exact = task.result()
        ctx.counted_prompt_tokens = exact.prompt_tokens
        _shrink_to(gw, ctx, exact)
        _record_blocks(gw, ctx)

    bound.exact.add_done_callback(done)


def _shrink_to(gw: BoundPorts, ctx: RequestContext, exact: Demand) -> None:
    """The request is the exact size from now on: its demand, and its reservation if held.

    Placed already, the reservation held the upper bound (4-5x a prompt of prose); it is
    lowered by the difference wherever it is counted, so the room is usable at once. Not
    placed yet, placement and any later attempt reserve the exact demand.
    """
    corrected = _corrected(gw, ctx.parsed, exact)
    over = ctx.demand - corrected.total
    if over <= 0:
        return
    ctx.prompt_tokens, ctx.demand = corrected.prompt_tokens, corrected.total
    for backend, tokens in gw.ledger.shrink(ctx.reservation_id, over):
        gw.local.shrink(backend, ctx.reservation_id, tokens)
        gw.pressure.recounted(ctx, backend)


def _record_blocks(gw: BoundPorts, ctx: RequestContext) -> None:
    """The prompt's block hashes (the exact count computed them) for affinity's index."""
    key = ctx.affinity
    if key is None:
        return
    spec = sizing.hash_spec(sizing.sizer_for(ctx.cfg), ctx.parsed, ctx.cfg.routing.prefix)
    hashes = sizing.take_hashes(ctx.parsed, spec) if spec is not None else None
    if not hashes:
        return
    placed = key.later.backend if key.later is not None else ""
    if placed:
        # Placed already: the backend holds these blocks now (a later attempt elsewhere
        # records nothing more; the index is a hint).
        gw.affinity.placed(AffinityKey(hashes, None), placed, gw.clock())
    else:
        ctx.affinity = AffinityKey(hashes, key.session, key.later, key.costs)
