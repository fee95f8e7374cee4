"""Learning at a bounded rate: what is learned from answers costs the same at any traffic.

The gateway learns from whole JSON answers (the servers' ``usage``: output lengths for the
memory-pressure projection, prompt counts for the tokenizer calibration). Those are windows
and decayed averages: a few samples a second keep them as current as thousands do, while
reading every answer costs every request (measured on tiny requests: the answer hooks were
part of a 15% regression, docs/benchmarks.md, section 9). A token bucket per key: the first
``burst`` answers all teach (a new model learns at once), then at most ``per_s`` a second.

Pure: time comes in as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SampleGate:
    """Per key, a token bucket of ``burst`` samples refilled at ``per_s`` a second."""

    per_s: float = 50.0
    burst: float = 50.0
    # Keys are model names, which clients choose: bounded (a full table starts again).
    max_keys: int = 1024
    _buckets: dict[str, list[float]] = field(default_factory=dict)

    def take(self, key: str, now: float) -> bool:
        """Whether this sample for ``key`` is to be learned from (it then spends one)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()
            self._buckets[key] = [self.burst - 1.0, now]
            return True
        # A clock set back refills nothing (it never drains the bucket either).
        tokens = min(self.burst, bucket[0] + max(0.0, now - bucket[1]) * self.per_s)
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - 1.0
        return True
