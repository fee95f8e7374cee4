"""Prefills run while their request waits for a decode server: bounded per prefill server.

A two-step request that no decode server fits yet holds at the gateway; its step 1 runs
meanwhile, so the hold costs ``max(prefill, wait)`` instead of their sum. The prefill
server then keeps the computed blocks until the decode server pulls them, which is later
than usual: for the rest of the hold. Unbounded, a long hold of many requests could fill a
prefill server with blocks nobody pulls yet, and its next prefills would queue behind
them. So the blocks held for waiting requests are counted per prefill server and capped at
a fraction of its KV (``disaggregation.early_prefill_fraction``); a server at its cap takes
no early prefill (the request prefills after its decode placement, as without the overlap).

Pure: the gateway says when blocks start to be held (step 1 decided during a hold, before
it is placed: ``proxy.gateway.hold_prefill``), where step 1 landed, and when the hold ends
(step 2 sent, or the request ended any other way).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class EarlyPrefills:
    """Prompt tokens each prefill server holds for requests still waiting for a decode server."""

    # backend -> request key -> prompt tokens held there for it
    held: dict[str, dict[str, int]] = field(default_factory=dict)
    # Held requests waiting for a share, in the order they first found none (a dict: ordered).
    waiting: dict[str, None] = field(default_factory=dict)

    def add(self, backend: str, key: str, tokens: int) -> None:
        """Step 1 of ``key`` decided during its hold, for ``backend``: its blocks will stay there."""
        self.held.setdefault(backend, {})[key] = tokens
        self.waiting.pop(key, None)

    def wait(self, key: str) -> None:
        """``key`` found no share free: it joins the line for one (or keeps its place)."""
        self.waiting.setdefault(key, None)

    def turn(self, key: str) -> bool:
        """``key`` may take a share now: nobody waits for one, or it waits longest.

        Without the line, a share that freed went to whichever held request looked first,
        often one that had just arrived: in the disaggregated benchmark at its larger scale,
        documents that found every share taken waited out their whole hold (60 s) while
        newer ones took the shares.
        """
        return next(iter(self.waiting), key) == key

    def release(self, key: str) -> list[str]:
        """``key``'s hold ended (step 2 sent, or the request ended); the backends it freed."""
        self.waiting.pop(key, None)
        freed = []
        for backend in list(self.held):
            mine = self.held[backend]
            if mine.pop(key, None) is not None:
                freed.append(backend)
                if not mine:
                    del self.held[backend]
        return freed

    def move(self, key: str, backend: str) -> list[str]:
        """``key``'s share, taken when its step 1 was decided, goes to the server step 1
        landed on (nothing if it holds none); the backends whose count changed."""
        for name, mine in list(self.held.items()):
            if key in mine and name != backend:
                tokens = mine.pop(key)
                if not mine:
                    del self.held[name]
                self.add(backend, key, tokens)
                return [name, backend]
        return []

    def tokens(self, backend: str) -> int:
        return sum(self.held.get(backend, {}).values())

    def full(
        self,
        servers: Iterable[str],
        capacity: Mapping[str, int],
        prompt_tokens: int,
        fraction: float,
    ) -> frozenset[str]:
        """Prefill servers that may not hold ``prompt_tokens`` more for a waiting request.

        A server without a known capacity (no report yet) counts as full: the bound cannot
        be checked there.
        """
        return frozenset(
            name
            for name in servers
            if self.tokens(name) + prompt_tokens > fraction * capacity.get(name, 0)
        )

    def __len__(self) -> int:
        return sum(len(m) for m in self.held.values())
