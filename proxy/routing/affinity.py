"""Prefix-cache and session affinity that never overrides fit (used by the kvroute policy).

Peer routers (vllm-router ``cache_aware``, SGLang's router, llm-d, Dynamo) send a request to
the node that holds its prefix, whether or not it fits there; on fragmenting backends that
failed 58.6% of the bimodal mix. Here the saving only reorders nodes that already passed
the fit test, so a cached prefix can win a node only where the request fits:

1. Fit stays hard. For lazily allocating, paged servers (``report.queueing``: vLLM, SGLang,
   TGI) the demand tested is lowered by the cached tokens, since the server reuses those
   blocks instead of allocating new ones (the lazy accounting counts every in-flight
   request at full demand, which counts a shared document once per question otherwise).
   Never for contiguous or allocate-at-admission servers, which allocate the whole request.
2. Overloaded nodes never win by affinity: pressure (queue, preemptions, slots, asleep)
   already makes them not fit, and above ``max_utilisation`` a node keeps its place in
   the fit order.
3. Among the rest, a node whose expected saving is at least ``min_saving_tokens`` moves
   ahead, best score first: ``gain * (1 - load_weight * utilisation)``, where ``gain`` is
   the cached prompt tokens plus ``session_tokens`` on the session's last node.
   Everything else keeps the fit order (long: best fit; short: into gaps).
4. A prompt worth caching that no node holds yet (``indexed`` given) goes, when every
   candidate is a paged, queueing server (no fragmentation to protect there), to the node
   whose cache holds least of what the gateway sent it, load weighed in:
   ``indexed / capacity + load_weight * utilisation``. New documents thus spread over the
   fleet's caches instead of piling onto the best-fit node and evicting each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from proxy.core.fleet import NodeView


@dataclass(frozen=True, slots=True)
class AffinitySettings:
    """Weights of the affinity rule (config: ``routing.prefix``; see the module docstring)."""

    enabled: bool = True
    min_saving_tokens: int = 512
    load_weight: float = 1.0
    max_utilisation: float = 0.9
    session_tokens: int = 1024
    discount_paged: bool = True
    spread_new: bool = True


def reuses_cached_blocks(n: NodeView) -> bool:
    """Servers that share cached prefix blocks with a new request instead of allocating them."""
    return n.report is not None and n.report.queueing and n.report.allocator == "paged"


def demand_on(
    n: NodeView, demand: int, cached: Mapping[str, int], settings: AffinitySettings
) -> int:
    """The demand to test against ``n``: less its cached prefix where the server reuses it."""
    if not settings.enabled or not settings.discount_paged or not cached:
        return demand
    saving = cached.get(n.name, 0)
    if saving <= 0 or not reuses_cached_blocks(n):
        return demand
    # At least one token is always computed (and a block allocated) for the request itself.
    return max(1, demand - saving)


def utilisation(n: NodeView) -> float:
    """How full ``n`` is for new work: what the fit test leaves (lazy accounting included)."""
    r = n.report
    if r is None or r.capacity_tokens <= 0:
        return 1.0
    return 1.0 - min(r.capacity_tokens, n.usable_block()) / r.capacity_tokens


def prefer_cached(
    ordered: list[NodeView],
    cached: Mapping[str, int],
    session_node: str | None,
    settings: AffinitySettings,
    indexed: Mapping[str, int] | None = None,
) -> list[NodeView]:
    """``ordered`` (nodes that fit, best first) with the worthwhile affinity nodes moved ahead."""
    if not settings.enabled:
        return ordered
    if not cached and session_node is None:
        return spread_new(ordered, indexed, settings) if indexed is not None else ordered
    scored: list[tuple[float, int, NodeView]] = []
    for i, n in enumerate(ordered):
        gain = cached.get(n.name, 0)
        if session_node is not None and n.name == session_node:
            gain += settings.session_tokens
        if gain < settings.min_saving_tokens or gain <= 0:
            continue
        load = utilisation(n)
        if load > settings.max_utilisation:
            continue
        scored.append((-gain * (1.0 - settings.load_weight * load), i, n))
    if not scored:
        return spread_new(ordered, indexed, settings) if indexed is not None else ordered
    scored.sort(key=lambda t: (t[0], t[1]))
    ahead = [n for _, _, n in scored]
    moved = {n.name for n in ahead}
    return ahead + [n for n in ordered if n.name not in moved]


def spread_new(
    ordered: list[NodeView], indexed: Mapping[str, int], settings: AffinitySettings
) -> list[NodeView]:
    """A new prefix worth caching: the paged node whose cache it displaces least (rule 4)."""
    if not settings.spread_new or not ordered or not all(map(reuses_cached_blocks, ordered)):
        return ordered

    def cost(n: NodeView) -> float:
        cap = n.report.capacity_tokens if n.report is not None else 0
        held = indexed.get(n.name, 0) / cap if cap > 0 else 1.0
        return held + settings.load_weight * utilisation(n)

    rank = {n.name: i for i, n in enumerate(ordered)}
    return sorted(ordered, key=lambda n: (cost(n), rank[n.name]))
