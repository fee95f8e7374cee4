"""How a simulated server cuts its generated tokens into SSE events and when it flushes them.

vLLM's ``--stream-interval N`` sends up to N tokens per event (1, its default: one event per
token), the first token at once; an engine may also flush its socket only every so often
(the independent engine of issue 53 flushes every 50 ms). Clients that time the first token
or count events see the difference, so both are flags (``--stream-interval``,
``--flush-interval-s``) rather than whatever the step loop happens to produce.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pacing:
    """``stream_interval`` tokens per event (0: all tokens new since the last flush in one
    event, the classic model's way); at most one flush per ``flush_interval_s`` (wall time)."""

    stream_interval: int = 0
    flush_interval_s: float = 0.0

    def ready(self, sent: int, generated: int, output: int) -> bool:
        """Whether what is generated but not sent goes out now: the first token, the last,
        or a full event's worth."""
        new = generated - sent
        if new <= 0:
            return False
        if self.stream_interval <= 1 or sent == 0 or generated >= output:
            return True
        return new >= self.stream_interval

    def pieces(self, new: int) -> list[int]:
        """How many tokens each event carries when ``new`` tokens go out at once."""
        n = self.stream_interval
        if n <= 0:
            return [new]
        return [min(n, new - i) for i in range(0, new, n)]
