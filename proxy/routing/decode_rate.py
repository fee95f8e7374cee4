"""Each backend's decode rate, as its streams show it; the configured rate otherwise.

The hold on a queueing backend waits for its running requests to write their way out
(``MemoryPressure.hand_over``: decode steps until the room is free, over the decode rate),
and the configured rate is a guess about hardware and model (30 tokens/s per request by
default). On engines running at ten times that, every hold was sized ten times too long
(issue 53). The gateway relays every stream, so it sees the rate itself: tokens written after
the first, over the time from the first event to the end. The median of the last ``window``
streams that wrote at least ``min_tokens`` is the backend's rate.

Pure: the gateway feeds it one sample per stream that ended well.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_TOKENS = 8
WINDOW = 32
MIN_SAMPLES = 5


@dataclass
class DecodeRates:
    """Per backend: the rates of its recent streams (tokens per second per request)."""

    window: int = WINDOW
    samples: dict[str, deque[float]] = field(default_factory=dict)

    def observe(self, backend: str, tokens: int, seconds: float) -> None:
        """One stream: ``tokens`` written over ``seconds`` since its first event."""
        if tokens < MIN_TOKENS or seconds <= 0:
            return
        kept = self.samples.get(backend)
        if kept is None:
            kept = self.samples[backend] = deque(maxlen=self.window)
        kept.append((tokens - 1) / seconds)

    def rate(self, backend: str) -> float | None:
        """The median of the recent streams' rates, or None while fewer than a few."""
        kept = self.samples.get(backend)
        if kept is None or len(kept) < MIN_SAMPLES:
            return None
        return statistics.median(kept)

    def forget(self, backend: str) -> None:
        self.samples.pop(backend, None)
