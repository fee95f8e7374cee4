"""One node's terms of a request's expected time to first token (``proxy.routing.expected_ttft``).

A module of its own, importing nothing of ``proxy.routing``: ``RouteRequest`` carries these
per node, and the policy contract must not import the rule that computes them.
"""

from __future__ import annotations

from dataclasses import dataclass


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
