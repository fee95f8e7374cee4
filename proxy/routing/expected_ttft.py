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
end. The gateway cannot see other clients' prompts this way, so the node's reported queue
(``proxy.routing.queueing.expected_wait_s``) bounds it from below. Pure: times come in as
arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.core.fleet import NodeView
from proxy.routing.queueing import is_queueing


@dataclass(frozen=True, slots=True)
class NodeCost:
    """One node's terms for a request: its prefill backlog and what it would compute."""

    backlog_s: float
    uncached_tokens: int
    tokens_per_s: float

    @property
    def ttft_s(self) -> float:
        """Expected seconds to this request's first token there."""
        return self.backlog_s + self.uncached_tokens / self.tokens_per_s


@dataclass
class PrefillBacklog:
    """When each node's prefill queue, as this gateway filled it, is expected to be empty."""

    busy_until: dict[str, float] = field(default_factory=dict)

    def wait_s(self, node: str, now: float) -> float:
        """Seconds of prefill queued on ``node`` ahead of a request placed now."""
        return max(0.0, self.busy_until.get(node, now) - now)

    def add(self, node: str, tokens: int, tokens_per_s: float, now: float) -> None:
        """A request placed on ``node`` that will prefill ``tokens`` after what is queued."""
        if tokens <= 0 or tokens_per_s <= 0:
            return
        start = max(now, self.busy_until.get(node, now))
        self.busy_until[node] = start + tokens / tokens_per_s
        if len(self.busy_until) > 4 * 1024:
            # Names of backends long gone: drop those already idle.
            self.busy_until = {k: v for k, v in self.busy_until.items() if v > now}

    def forget(self, node: str) -> None:
        """The node restarted or left: nothing of ours is queued there any more."""
        self.busy_until.pop(node, None)


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
