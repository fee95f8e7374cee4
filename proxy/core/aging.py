"""Held requests are not overtaken without bound: a long request waiting at the gateway ends.

While the gateway holds requests (nothing fits without risking preemption), small requests
fit the room that frees first, again and again, and a long one could wait forever. Each
held request counts how many requests were placed after it arrived while it waited; once
one has been overtaken ``max_overtakes`` times it is *starving*, and the room that frees on
one node is kept for it: that node (its ``target``, the one it is nearest to fitting on)
takes nothing newer until it is placed, except what is expected to end before that room
frees (EASY backfilling, as batch schedulers keep a reservation for the job at the head of
their queue). Its wait is bounded by that node's drain.

Only that node: the rule first stopped every newer placement on the whole fleet, and at
30 arrivals a second eight overtakes take a quarter of a second, so chats that fit on three
other nodes queued behind one held document (measured on the do-no-harm grid's memory cell,
classic engine model: 208 of 311 holds were chats that fit somewhere, held only by this
rule; short TTFT p50 1.8 s against ``power_of_two``'s 0.42 s). Until a starving request
has named its node (its next look at the fleet, within one hold tick), nothing newer is
placed anywhere, as before.

Pure: callers say when a request is held, placed or gone, and which node a starving one
waits for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Held:
    arrived: int  # arrival order
    overtaken: int = 0
    target: str | None = None  # the node kept for it once it is starving
    # Decode steps until the target's flights free its room (inf: not known to come).
    free_in: float = math.inf


@dataclass
class HeldOrder:
    """The requests held at the gateway in arrival order, with their overtake counts."""

    max_overtakes: int = 8
    _held: dict[str, _Held] = field(default_factory=dict)
    _arrivals: int = 0

    def hold(self, key: str) -> None:
        """``key`` starts (or keeps) waiting; its place in line is its first hold."""
        if key not in self._held:
            self._arrivals += 1
            self._held[key] = _Held(self._arrivals)

    def _order(self, key: str) -> int:
        mine = self._held.get(key)
        return mine.arrived if mine is not None else self._arrivals + 1

    def may_place(self, key: str) -> bool:
        """False while an older starving request has not named its node yet (``key`` waits)."""
        order = self._order(key)
        return not any(
            h.arrived < order and h.overtaken >= self.max_overtakes and h.target is None
            for h in self._held.values()
        )

    def kept(self, key: str, steps: float = math.inf) -> frozenset[str]:
        """The nodes ``key`` may not take: those kept for older starving requests.

        ``steps``: decode steps ``key`` is expected to run. A node whose room for the
        starving request frees later than that stays open to it (backfilling: it ends
        before the starving request could start there, so it delays nothing).
        """
        order = self._order(key)
        return frozenset(
            h.target
            for h in self._held.values()
            if h.arrived < order
            and h.overtaken >= self.max_overtakes
            and h.target is not None
            and steps >= h.free_in
        )

    def needs_target(self, key: str) -> bool:
        """``key`` is starving and has no node kept for it yet."""
        mine = self._held.get(key)
        return mine is not None and mine.overtaken >= self.max_overtakes and mine.target is None

    def target(self, key: str) -> str | None:
        mine = self._held.get(key)
        return mine.target if mine is not None else None

    def keep(self, key: str, node: str | None, free_in: float = math.inf) -> None:
        """Keep ``node``'s room for the starving request ``key`` (None: no node for it now),
        expected to be free in ``free_in`` decode steps (refreshed at each of its looks)."""
        mine = self._held.get(key)
        if mine is not None:
            mine.target = node
            mine.free_in = free_in

    def placed(self, key: str) -> None:
        """``key`` was placed: every older request still held was overtaken once more."""
        order = self._order(key)
        self._held.pop(key, None)
        for h in self._held.values():
            if h.arrived < order:
                h.overtaken += 1

    def gone(self, key: str) -> None:
        """``key`` left without being placed (its client went away, its time ran out)."""
        self._held.pop(key, None)

    def starving(self) -> int:
        """Held requests at their overtake limit (a gauge)."""
        return sum(1 for h in self._held.values() if h.overtaken >= self.max_overtakes)

    def __len__(self) -> int:
        return len(self._held)
