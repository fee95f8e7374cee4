"""Offline: prefix-cache affinity on a vLLM-like fleet, to choose ``routing.prefix`` weights.

The shared-document workload (``loadtest.workload.shared_documents``: 30% questions about
one of 40 documents of 15-30k tokens, Zipf popularity, multi-turn follow-ups; the rest short
chats) runs against a model of paged, prefix-caching servers, routed by the same policy code
the gateway runs (``proxy.routing``) with the gateway's prefix index (``proxy.core.prefix``).

The server model (per node, event by event, no asyncio):

* KV in blocks; a request holds its prompt blocks (shared by hash with running requests,
  reused from the free pool's cached blocks, else new) plus its own output blocks, at full
  length from admission (a simplification of lazy growth: no preemption here);
* cached blocks are freed blocks that keep their content, evicted least recently freed first
  when the allocator needs blocks;
* prefill is one GPU's compute: prompts are prefilled one after another at
  ``prefill_tokens_per_s``, cached tokens skipped; time to first token = waiting for room
  and for the prefill queue + own prefill; decode at ``decode_tokens_per_s`` per request.

    python -m loadtest.sim.prefix                  # policies side by side
    python -m loadtest.sim.prefix --sweep          # the routing.prefix weight grid
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.workload import SharedDocs, Turn, shared_documents
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.core.prefix import PrefixIndex, PrefixIndexConfig
from proxy.routing import PolicySettings, RouteRequest, classify, make_policy
from proxy.routing.affinity import AffinitySettings

BLOCK = 16


@dataclass
class SimCfg:
    nodes: int = 4
    capacity_tokens: int = 200_000
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 50.0


@dataclass
class _Running:
    end: float
    own_blocks: int
    hashes: tuple[int, ...]
    demand: int


@dataclass
class SimNode:
    """One paged, prefix-caching server."""

    name: str
    cfg: SimCfg
    free_blocks: int = 0
    pinned: dict[int, int] = field(default_factory=dict)
    cached: OrderedDict[int, None] = field(default_factory=OrderedDict)
    running: list[tuple[float, int, _Running]] = field(default_factory=list)
    prefill_free_at: float = 0.0
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.free_blocks = self.cfg.capacity_tokens // BLOCK

    def finish_until(self, now: float) -> None:
        while self.running and self.running[0][0] <= now:
            _, _, r = heapq.heappop(self.running)
            self._release(r)

    def _release(self, r: _Running) -> None:
        freed = r.own_blocks
        for h in reversed(r.hashes):
            n = self.pinned.get(h, 0) - 1
            if n > 0:
                self.pinned[h] = n
                continue
            self.pinned.pop(h, None)
            self.cached[h] = None
            self.cached.move_to_end(h)
            freed += 1
        self.free_blocks += freed

    def admit(
        self, now: float, hashes: tuple[int, ...], prompt: int, output: int
    ) -> tuple[float, int]:
        """Run one request; returns (time to first token, cached prompt tokens)."""
        hits = shared = 0
        for h in hashes:
            if h in self.pinned:
                shared += 1
            elif h not in self.cached:
                break
            hits += 1
        need = -(-(prompt + output) // BLOCK)
        start = now
        # No room: wait for running requests to end (FIFO per node, as the server queues).
        while need - shared > self.free_blocks and self.running:
            start = max(start, self.running[0][0])
            self.finish_until(start)
        for h in hashes:
            n = self.pinned.get(h)
            if n is None:
                self.cached.pop(h, None)
                self.pinned[h] = 1
            else:
                self.pinned[h] = n + 1
        own = need - len(hashes)
        self.free_blocks -= need - shared
        while len(self.cached) > max(0, self.free_blocks):
            self.cached.popitem(last=False)
        cached_tokens = min(hits * BLOCK, prompt - 1)
        prefill_start = max(start, self.prefill_free_at)
        first = prefill_start + (prompt - cached_tokens) / self.cfg.prefill_tokens_per_s
        self.prefill_free_at = first
        end = first + output / self.cfg.decode_tokens_per_s
        r = _Running(end, own, hashes, prompt + output)
        heapq.heappush(self.running, (end, next(self._seq), r))
        return first - now, cached_tokens

    def view(self, now: float) -> NodeView:
        cap = self.cfg.capacity_tokens
        free = self.free_blocks * BLOCK
        report = MemoryReport(
            capacity_tokens=cap,
            free_tokens=free,
            largest_free_block_tokens=free,
            allocator="paged",
            block_size=BLOCK,
            running=len(self.running),
            reported_at=now,
            queueing=True,
        )
        reserved = sum(r.demand for _, _, r in self.running)
        backlog = self.prefill_free_at - now
        overlay = Overlay(
            reserved_tokens=reserved,
            inflight=len(self.running),
            # More than a second of prefill queued: the server is queueing new work.
            pressure="queue" if backlog > 1.0 else "",
        )
        return NodeView(self.name, report=report, overlay=overlay)


def turn_hashes(w: SharedDocs, t: Turn, history: Sequence[Turn]) -> tuple[tuple[int, ...], int]:
    """Block hashes of a turn's prompt (document, earlier turns, question) and its length."""
    tokens = 0
    parts: list[tuple[object, int]] = []
    if t.doc is not None:
        parts.append((("doc", t.doc), w.doc_tokens[t.doc]))
    for past in history:
        parts.append((("q", t.conversation, past.turn), past.question_tokens + past.output_tokens))
    parts.append((("q", t.conversation, t.turn), t.question_tokens))
    # Content addressed by (part, position): equal prefixes give equal chained hashes.
    out: list[int] = []
    parent = 0
    stream: list[tuple[object, int]] = []
    for key, n in parts:
        stream.extend((key, i) for i in range(n))
        tokens += n
    for b in range(len(stream) // BLOCK):
        parent = hash((parent, tuple(stream[b * BLOCK : (b + 1) * BLOCK])))
        out.append(parent)
    return tuple(out), tokens


@dataclass
class SimOutcome:
    label: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    doc_ttft_p50_s: float
    by_node: tuple[int, ...]


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def simulate(
    w: SharedDocs,
    policy_name: str,
    affinity: AffinitySettings,
    cfg: SimCfg,
    label: str = "",
    index_block: int = BLOCK,
) -> SimOutcome:
    """``index_block``: the gateway index's block (a multiple of the servers' ``BLOCK``): every
    k-th hash of a chain over ``BLOCK``-token blocks is a chain over k × ``BLOCK`` tokens."""
    nodes = [SimNode(f"n{i}", cfg) for i in range(cfg.nodes)]
    settings = PolicySettings(long_threshold_tokens=8_000, affinity=affinity)
    policy = make_policy(policy_name, settings)
    index = PrefixIndex(PrefixIndexConfig(block_tokens=index_block))
    k = max(1, index_block // BLOCK)
    history: dict[int, list[Turn]] = {}
    hits = prompts = 0
    ttfts: list[float] = []
    doc_ttfts: list[float] = []
    counts = [0] * cfg.nodes
    for t in w.turns:
        now = t.arrival_s
        past = history.setdefault(t.conversation, [])
        hashes, prompt = turn_hashes(w, t, past)
        keys = hashes[k - 1 :: k]
        past.append(t)
        for n in nodes:
            n.finish_until(now)
        snap = FleetSnapshot(tuple(n.view(now) for n in nodes), taken_at=now)
        cached = {}
        if affinity.enabled:
            for n in nodes:
                m = index.match(n.name, keys, now)
                if m:
                    cached[n.name] = m * index_block
        demand = prompt + t.output_tokens
        indexed = None
        if affinity.enabled and len(keys) * index_block >= affinity.min_saving_tokens:
            indexed = {n.name: index.size(n.name) * index_block for n in nodes}
        req = RouteRequest(demand, classify(demand, 8_000), cached=cached, indexed=indexed)
        ranked = policy.rank(snap, req, now) or [min(nodes, key=lambda n: n.prefill_free_at).name]
        i = int(ranked[0][1:])
        ttft, hit = nodes[i].admit(now, hashes, prompt, t.output_tokens)
        index.record(nodes[i].name, keys, now)
        counts[i] += 1
        hits += hit
        prompts += prompt
        ttfts.append(ttft)
        if t.doc is not None:
            doc_ttfts.append(ttft)
    return SimOutcome(
        label or policy_name,
        hits / prompts if prompts else 0.0,
        pct(ttfts, 0.5),
        pct(ttfts, 0.99),
        pct(doc_ttfts, 0.5),
        tuple(counts),
    )


def row(o: SimOutcome) -> str:
    return (
        f"| {o.label} | {o.hit_rate:.1%} | {1000 * o.ttft_p50_s:.0f} | {1000 * o.ttft_p99_s:.0f} "
        f"| {1000 * o.doc_ttft_p50_s:.0f} | {'/'.join(map(str, o.by_node))} |"
    )


HEAD = "| routing | hit rate | TTFT p50 ms | TTFT p99 ms | doc TTFT p50 ms | requests per node |\n|---|---|---|---|---|---|"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.sim.prefix", description=__doc__)
    p.add_argument("--requests", type=int, default=3_000)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--sweep", action="store_true")
    p.add_argument(
        "--index-blocks",
        type=int,
        nargs="*",
        default=[],
        help="also run affinity with the gateway index hashing blocks of these many tokens "
        f"(multiples of {BLOCK})",
    )
    args = p.parse_args(argv)
    cfg = SimCfg()
    loads = [shared_documents(args.requests, args.rate, seed=s) for s in range(args.seeds)]

    def run(policy: str, aff: AffinitySettings, label: str, block: int = BLOCK) -> SimOutcome:
        outs = [simulate(w, policy, aff, cfg, label, block) for w in loads]
        k = len(outs)
        return SimOutcome(
            label,
            sum(o.hit_rate for o in outs) / k,
            sum(o.ttft_p50_s for o in outs) / k,
            sum(o.ttft_p99_s for o in outs) / k,
            sum(o.doc_ttft_p50_s for o in outs) / k,
            outs[0].by_node,
        )

    print(HEAD)
    off = AffinitySettings(enabled=False)
    print(row(run("round_robin", off, "round robin")), flush=True)
    print(row(run("kvroute", off, "kvroute, no affinity")), flush=True)
    print(row(run("kvroute", AffinitySettings(), "kvroute + affinity (defaults)")), flush=True)
    no_spread = AffinitySettings(spread_new=False)
    print(row(run("kvroute", no_spread, "kvroute + affinity, no spread")), flush=True)
    for block in args.index_blocks:
        label = f"kvroute + affinity, index block {block}"
        print(row(run("kvroute", AffinitySettings(), label, block)), flush=True)
    if args.sweep:
        for min_saving, load_w, max_util in itertools.product(
            (0, 512, 4_096), (0.0, 1.0), (0.8, 0.9, 1.0)
        ):
            aff = AffinitySettings(
                min_saving_tokens=min_saving, load_weight=load_w, max_utilisation=max_util
            )
            label = f"min {min_saving}, load {load_w}, max util {max_util}"
            print(row(run("kvroute", aff, label)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
