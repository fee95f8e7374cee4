"""Held requests are not overtaken without bound: a long request waiting at the gateway ends.

While the gateway holds requests (nothing fits without risking preemption), small requests
fit the room that frees first, again and again, and a long one could wait forever. Each
held request counts how many requests were placed after it arrived while it waited; once
one has been overtaken ``max_overtakes`` times, nothing newer than it is placed until it is
(the room that frees is kept for it). The rule bounds its wait by the time that
``max_overtakes`` placements plus its own take, and costs short requests little: they
overtake freely until then.

Pure: callers say when a request is held, placed or gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Held:
    arrived: int  # arrival order
    overtaken: int = 0


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

    def may_place(self, key: str) -> bool:
        """False while an older held request has been overtaken its limit (``key`` waits)."""
        mine = self._held.get(key)
        order = mine.arrived if mine is not None else self._arrivals + 1
        return not any(
            h.arrived < order and h.overtaken >= self.max_overtakes for h in self._held.values()
        )

    def placed(self, key: str) -> None:
        """``key`` was placed: every older request still held was overtaken once more."""
        mine = self._held.pop(key, None)
        order = mine.arrived if mine is not None else self._arrivals + 1
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
