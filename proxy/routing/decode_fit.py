"""The decode step of a two-step request: among the decode servers that fit, the tightest.

A decode server holds the whole KV of every request it serves (prompt and output, for the
whole generation), and a disaggregated fleet holds a request at the gateway until one fits
(docs/disaggregation.md): what delays the first token there is that wait, not a queue. The
idea is the rule kvroute applies to long requests on contiguous servers: best fit, the
server with the least room that still holds the request's projected peak, to keep the
largest room whole for the next long document (spreading can leave every decode server
half full, and a long document then fits none of them until something ends).

Measured on the disaggregation benchmark (docs/benchmarks.md, section 10) it did not lower
the TTFT p99 steadily and left the decode servers less balanced: an option
(``disaggregation.decode_order: best_fit``), not the default.

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
