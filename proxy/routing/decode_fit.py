"""The decode step of a two-step request: among the decode servers that fit, the tightest.

A decode server holds the whole KV of every request it serves (prompt and output, for the
whole generation), and a disaggregated fleet holds a request at the gateway until one fits
(docs/disaggregation.md): what delays the first token there is that wait, not a queue. The
idea is the rule kvroute applies to long requests on contiguous servers: best fit, the
server with the least room that still holds the request's projected peak, to keep the
largest room whole for the next long document (spreading can leave every decode server
half full, and a long document then fits none of them until something ends).

It is the default with vLLM's protocol (``disaggregation.decode_order: best_fit``; with
SGLang's, where it cost one decode preemption a run, spread is). Measured on the
disaggregation benchmark's heavy load (docs/benchmarks.md, section 10), once the fit was
the projection's alone: TTFT p99 1.38 s against spread's 4.82 s on its own request list,
0.30 s against 3.03 s on another, 9.11 s against 7.18 s on an overloaded third; decode
servers within 8 percentage points in each. (Before that, the store's full-demand check
refused the tightest server and the request went elsewhere: best fit did not pack, and
measured no steady gain.)

Only the order changes: the inner policy decides what fits (projection, margins, exclusions);
where a server probably caches the prompt's prefix, the inner (affinity) order stands.
Pure: no I/O.
"""

from __future__ import annotations

from proxy.core.fleet import FleetSnapshot
from proxy.routing.policy import Policy, RouteRequest


class DecodeFitPolicy(Policy):
    """``inner``'s ranking, reordered by the least room that fits (long requests only)."""

    name = "decode_fit"

    def __init__(self, inner: Policy) -> None:
        super().__init__(inner.settings)
        self.inner = inner
        self.checks_fit = inner.checks_fit

    def rank(self, snapshot: FleetSnapshot, req: RouteRequest, now: float) -> list[str]:
        ranked = self.inner.rank(snapshot, req, now)
        if req.cls != "long" or len(ranked) < 2 or any(req.cached.get(n, 0) for n in ranked):
            # Short requests spread; a cached prefix somewhere: the inner (affinity) order.
            return ranked
        nodes = snapshot.by_name()
        order = {name: i for i, name in enumerate(ranked)}

        def room(name: str) -> tuple[int, int]:
            n = nodes.get(name)
            # No report (room unknown): after every node whose room is known.
            block = n.usable_block() if n is not None and n.report is not None else 1 << 62
            return (block, order[name])

        return sorted(ranked, key=room)
