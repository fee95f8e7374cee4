"""Queueing backends: rank by expected time to first token, the place to wait when nothing fits.

vLLM, SGLang and TGI never refuse work for lack of KV: they queue it. So when no queueing
backend "fits" a request now (its KV headroom with lazy growth is short, or it shows a
queue, preemptions or full slots), the gateway does not answer 503: after a bounded hold
(late binding, ``proxy.gateway.placement``) it forwards to the backend where the request is
expected to start soonest. This module says which, purely from the fleet snapshot.

Expected wait on one node (seconds), with ``engines`` prefilling in parallel:

* prefill backlog ahead: requests queued there (the report's ``waiting``, or the gateway's
  own in-flight requests not yet running, whichever is larger) at the gateway's mean
  in-flight size there, plus this request's prompt, over the prefill rate;
* KV: the part of the request that does not fit the lazy headroom (every in-flight request
  at its full demand), drained at the running requests' decode rate (preemption risk);
* slots: with ``max_num_seqs`` reached, a running request's remaining decode time
  (``DEFAULT_REMAINING_OUTPUT_TOKENS``) per queued request, over the slots.

Rates are configured per backend (``prefill_tokens_per_s``, ``decode_tokens_per_s``); the
defaults are a mid-size model on one modern GPU. The figures rank nodes and bound holds;
they are not promises.

Long requests: the long pool first, unless its best expected wait exceeds the best general
node's by more than ``spill_margin_s`` (the long pool protects short requests from long
prefills, but not at any price).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from proxy.core.fleet import NodeView
from proxy.routing.policy import RequestClass

DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_DECODE_TOKENS_PER_S = 30.0
# Mean request size assumed where the gateway has nothing in flight to learn it from.
DEFAULT_REQUEST_TOKENS = 1_000
# Output tokens a running request still has to write, on average, when a slot is awaited
# (a request's demand is mostly prompt: its size says little about its decode time).
DEFAULT_REMAINING_OUTPUT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Rates:
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_tokens_per_s: float = DEFAULT_DECODE_TOKENS_PER_S


@dataclass(frozen=True, slots=True)
class QueueingSettings:
    spill_margin_s: float = 1.0
    # Per backend name; absent names get the defaults.
    rates: Mapping[str, Rates] = field(default_factory=dict)


def is_queueing(n: NodeView) -> bool:
    """A node whose server queues rather than refuses (known from its report)."""
    return n.report is not None and n.report.queueing


def occupied(n: NodeView) -> int:
    """Requests running or waiting on ``n`` now: the gateway's own count where it has any
    there (its live reservations, every replica's through the store), else the report's.

    A report is a scrape old when a request ranks on it, and on a server bound by its slots
    that is much of a request's life: it still counts requests that have ended and misses
    those sent since, while the gateway's count changes at once. Taken as ``max(report, in
    flight)``, a server whose slots had just freed ranked as full and the next requests
    queued on the others: the do-no-harm grid's slots cells lost their TTFT p99 to
    ``power_of_two`` (2.13x and 2.25x, medians of 3 runs), and so did a rule that took the
    report whenever nothing had been sent or ended there since it (p50 1.34-1.77x on
    classic/slots). The gateway's own count passes them (docs/routing.md). A server the
    gateway has nothing on is judged by its report, which shows other clients' requests;
    on one it keeps busy, those are not seen here, as a blind router sees none.
    """
    r = n.report
    if r is None or n.overlay.inflight:
        return n.overlay.inflight
    return r.running + r.waiting


def queue_load(n: NodeView) -> float:
    """Requests on a queueing node per engine (``occupied``: the gateway's own in flight,
    updated at once by ``proxy.gateway.local_view``, so requests ranked on one snapshot
    spread)."""
    r = n.report
    if r is None:
        return float(n.overlay.inflight)
    return occupied(n) / max(1, r.engines)


def slot_turns(n: NodeView) -> float:
    """How many times every slot must free before a new request starts here (0: one is free).

    Needs the running-request limit (``max_num_seqs``: exported, configured or learned by the
    collector); unknown, it is 0 and ``queue_load`` alone orders the nodes.
    """
    r = n.report
    if r is None or not r.max_num_seqs:
        return 0.0
    return max(0, occupied(n) + 1 - r.max_num_seqs) / r.max_num_seqs


def queued_ahead(n: NodeView) -> int:
    """Requests that would start before a new one here: those beyond its slots (``occupied``;
    0: the limit ``max_num_seqs`` is not known, or no request waits)."""
    r = n.report
    if r is None or not r.max_num_seqs:
        return 0
    return max(0, occupied(n) - r.max_num_seqs)


def by_line_length(nodes: Iterable[NodeView]) -> list[NodeView]:
    """Servers by how long a new request waits in their line: the fewest requests ahead of it
    (``queued_ahead``), then the fewest slot turns, then the fewest in flight."""
    return sorted(nodes, key=lambda n: (queued_ahead(n), slot_turns(n), n.overlay.inflight, n.name))


def slot_limits_known(nodes: Iterable[NodeView]) -> bool:
    """Whether every node has a known ``max_num_seqs``: only then do slot waits compare them.

    vLLM does not export the limit; the collector learns it per server, each when its own
    reports show it pinned (``proxy.core.slot_limit``), and it decays on each at its own time.
    A node whose limit is not known has no slot wait however many requests it holds, so
    beside nodes with a known limit it looks free to every request: on the do-no-harm grid's
    slots cell (classic, 377 requests) one engine took half of them for 2 s with 10-15 in
    flight against the others' 3-5 (short TTFT p99 1.04-1.89 s against ``power_of_two``'s
    0.71 s). Without it, requests per engine (``queue_load``) order the nodes, as slot turns
    would among equal limits.
    """
    return all(n.report is not None and n.report.max_num_seqs for n in nodes)


def expected_wait_s(
    n: NodeView, prompt_tokens: int, demand: int, rates: Rates, slot_wait: bool = True
) -> float:
    """Seconds until this request's first token on ``n`` (an estimate; lower is better).

    ``slot_wait``: count the wait for a slot where the limit is known (off when ``n`` is
    compared with nodes whose limit is not, ``slot_limits_known``).
    """
    ov, r = n.overlay, n.report
    running = r.running if r is not None else 0
    waiting = r.waiting if r is not None else 0
    engines = max(1, r.engines if r is not None else 1)
    mean = ov.reserved_tokens // ov.inflight if ov.inflight > 0 else DEFAULT_REQUEST_TOKENS
    queued = max(waiting, ov.inflight - running)
    prefill = (queued * mean + prompt_tokens) / (rates.prefill_tokens_per_s * engines)
    kv = 0.0
    if r is not None:
        deficit = demand - n.usable_block()
        if deficit > 0:
            kv = deficit / (max(1, running) * rates.decode_tokens_per_s)
    slots = 0.0
    if slot_wait and r is not None and r.max_num_seqs and running >= r.max_num_seqs:
        per_slot = DEFAULT_REMAINING_OUTPUT_TOKENS / rates.decode_tokens_per_s
        slots = (queued + 1) * per_slot / r.max_num_seqs
    return prefill + kv + slots


def rank_by_wait(
    nodes: Iterable[NodeView],
    prompt_tokens: int,
    demand: int,
    cls: RequestClass,
    settings: QueueingSettings,
) -> list[tuple[str, float]]:
    """(name, expected wait) best first; long requests keep to the long pool within the margin.

    Slot waits count only where every node's slot limit is known (``slot_limits_known``).
    """
    nodes = list(nodes)
    slot_wait = slot_limits_known(nodes)

    def wait(n: NodeView) -> float:
        rates = settings.rates.get(n.name, Rates())
        return expected_wait_s(n, prompt_tokens, demand, rates, slot_wait)

    scored = sorted(((wait(n), n.name, n.role) for n in nodes), key=lambda t: (t[0], t[1]))
    if cls != "long":
        # Short requests: general nodes first; the long pool only if it is faster by the margin.
        return _prefer(scored, "general", settings.spill_margin_s)
    return _prefer(scored, "long", settings.spill_margin_s)


def _prefer(
    scored: Sequence[tuple[float, str, str]], role: str, margin: float
) -> list[tuple[str, float]]:
    """Nodes of ``role`` first, unless another is faster than the best of them by ``margin``."""
    mine = [t for t in scored if t[2] == role]
    others = [t for t in scored if t[2] != role]
    if mine and others and others[0][0] + margin < mine[0][0]:
        mine, others = others, mine
    return [(name, w) for w, name, _ in mine + others]
