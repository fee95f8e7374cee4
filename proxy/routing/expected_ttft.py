"""Cost-based placement of a cached prompt: the node expected to give its first token soonest.

Pure prefix affinity sends every question about a hot document to the one engine that holds
it, and that engine prefills them one after another: measured on the document workload,
kvroute's document TTFT p99 was the highest of all routers while its hit rate was 2-3x
theirs (docs/benchmarks.md section 8). The leading routers (Dynamo's KV router, llm-d's
scorers) weigh the cache against the queue instead. So does this rule, in time units:

    expected TTFT on n = backlog of uncomputed prefill on n / rate(n)
                         + this prompt's tokens NOT cached on n / rate(n)

A hot document therefore spills to a second engine exactly when its owner's queue costs more
than recomputing the document elsewhere, and comes back once the queue drains. Nodes whose
expected TTFT is within ``slack`` of the best keep the affinity order (so a near tie goes to
the cache, which keeps hit rates up: a copy elsewhere evicts something else); only nodes
worse than that move behind, slowest last.

The backlog is a virtual clock per node (``PrefillBacklog``): each placement adds its uncached
tokens at the node's prefill rate, starting when the node's previous prefill is expected to
end, bounded by what this gateway still has in flight there. The gateway cannot see other
clients' prompts this way, so the node's reported waiting requests bound it from below
(``reported_wait_s``). Pure: times come in as
arguments.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.core.fleet import NodeView
from proxy.routing.node_cost import NodeCost
from proxy.routing.queueing import DEFAULT_REQUEST_TOKENS, is_queueing

#: Placements remembered per node for the in-flight bound (more in flight: the clock bounds).
RECENT = 256


@dataclass
class PrefillBacklog:
    """When each node's prefill queue, as this gateway filled it, is expected to be empty.

    Two bounds, the smaller wins. The virtual clock drains at the node's prefill rate, and
    the learned rate reads low where prefills queue (``proxy.routing.prefill_rate``), so
    alone it would drain too slowly and keep a node "busy" long after its queue emptied.
    Hence also: only requests still in flight there can be queued, so the backlog is at
    most the uncached tokens of the node's last ``inflight`` placements (FIFO: the oldest
    ended first). A node with nothing of ours in flight has no backlog of ours.
    """

    busy_until: dict[str, float] = field(default_factory=dict)
    recent: dict[str, deque[int]] = field(default_factory=dict)

    def wait_s(self, node: str, now: float, inflight: int, tokens_per_s: float) -> float:
        """Seconds of prefill queued on ``node`` ahead of a request placed now."""
        clock = max(0.0, self.busy_until.get(node, now) - now)
        placed = self.recent.get(node)
        if inflight <= 0 or not placed or tokens_per_s <= 0:
            return 0.0
        newest = list(placed)[-inflight:]
        return min(clock, sum(newest) / tokens_per_s)

    def add(self, node: str, tokens: int, tokens_per_s: float, now: float) -> None:
        """A request placed on ``node`` that will prefill ``tokens`` after what is queued."""
        self.recent.setdefault(node, deque(maxlen=RECENT)).append(max(0, tokens))
        if tokens <= 0 or tokens_per_s <= 0:
            return
        start = max(now, self.busy_until.get(node, now))
        self.busy_until[node] = start + tokens / tokens_per_s
        if len(self.busy_until) > 4 * 1024:
            # Names of backends long gone: drop those already idle.
            self.busy_until = {k: v for k, v in self.busy_until.items() if v > now}
            self.recent = {k: v for k, v in self.recent.items() if k in self.busy_until}

    def forget(self, node: str) -> None:
        """The node restarted or left: nothing of ours is queued there any more."""
        self.busy_until.pop(node, None)
        self.recent.pop(node, None)


def reported_wait_s(n: NodeView, tokens_per_s: float) -> float:
    """The node's reported waiting requests, priced at the mean size of ours in flight there.

    vLLM exports how many requests wait, not their tokens; what this gateway has in flight
    there (reserved tokens per request) is the best guess at their size.
    """
    r, ov = n.report, n.overlay
    if r is None or r.waiting <= 0 or tokens_per_s <= 0:
        return 0.0
    mean = ov.reserved_tokens / ov.inflight if ov.inflight > 0 else DEFAULT_REQUEST_TOKENS
    return r.waiting * mean / tokens_per_s


def by_expected_ttft(
    ordered: list[NodeView], costs: Mapping[str, NodeCost], slack_s: float
) -> list[NodeView]:
    """``ordered`` with nodes slower than the best by more than ``slack_s`` moved behind.

    A node within ``slack_s`` of the best expected TTFT keeps its place (the affinity
    order). Applies only when every node is a queueing server with a cost (a fail-fast
    node's order protects its blocks from fragmentation, not a queue).
    """
    if len(ordered) < 2 or not all(n.name in costs and is_queueing(n) for n in ordered):
        return ordered
    ttft = {n.name: costs[n.name].ttft_s for n in ordered}
    bound = min(ttft.values()) + max(0.0, slack_s)
    near = [n for n in ordered if ttft[n.name] <= bound]
    far = sorted((n for n in ordered if ttft[n.name] > bound), key=lambda n: ttft[n.name])
    return near + far


def slack_s(prompt_tokens: int, costs: Mapping[str, NodeCost], slack: float) -> float:
    """``slack`` as seconds: that fraction of the prompt's full prefill on the fastest node."""
    fastest = max((c.tokens_per_s for c in costs.values()), default=0.0)
    return slack * prompt_tokens / fastest if fastest > 0 else 0.0
