"""Each backend's prefill rate, learned from its own counters; the configured rate otherwise.

The expected wait on a queueing backend (``proxy.routing.queueing``) divides the prefill
backlog by the backend's prefill rate. A configured figure is a guess about hardware, model
and prompt mix; the server's own metrics say what it actually does. vLLM exports, per
finished request, the seconds spent prefilling and the prompt tokens (histograms whose sums
the adapter puts on the report as two cumulative counters: ``MemoryReport.prefill_tokens``
and ``prefill_seconds``). Their rise between reports is the rate now.

The estimate keeps a sliding window of the most recent ``window_s`` seconds of prefill work
(older work is scaled away as new work arrives, independent of the scrape interval), and is
used only once ``min_tokens`` prompt tokens back it. A counter that falls (the server
restarted) starts the window again. Where per-request prefills overlap (a batch prefilling
together), summed prefill seconds exceed wall time and the rate reads low: conservative,
it ranks a busy node as slower, never faster.

Pure: reports in, rates out; the gateway feeds it every snapshot (a report already taken in,
same ``reported_at``, changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.core.fleet import MemoryReport

# Prefill work kept in the estimate (seconds of prefill, summed over requests).
WINDOW_S = 30.0
# Prompt tokens the estimate needs before it replaces the configured rate.
MIN_TOKENS = 2_000.0


@dataclass(frozen=True, slots=True)
class Learned:
    """One backend's window: the counters last seen, and the work inside the window."""

    reported_at: float = -1.0
    last_tokens: float = 0.0
    last_seconds: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0

    def rate(self, min_tokens: float = MIN_TOKENS) -> float | None:
        """Tokens per second per engine, or None while the window holds too little work."""
        if self.tokens < min_tokens or self.seconds <= 0:
            return None
        return self.tokens / self.seconds


def next_learned(prev: Learned, report: MemoryReport, window_s: float = WINDOW_S) -> Learned:
    """The window after one more report (pure)."""
    if report.reported_at <= prev.reported_at:
        return prev
    tokens, seconds = report.prefill_tokens, report.prefill_seconds
    if tokens <= 0 or seconds <= 0:
        # Not exported (or nothing finished yet): nothing to learn from this report.
        return Learned(report.reported_at, 0.0, 0.0, prev.tokens, prev.seconds)
    fresh = prev.reported_at < 0 or tokens < prev.last_tokens or seconds < prev.last_seconds
    if fresh:
        # First report, or a counter fell (restart): its lifetime totals are the window.
        d_tokens, d_seconds = tokens, seconds
        acc_tokens, acc_seconds = 0.0, 0.0
    else:
        d_tokens, d_seconds = tokens - prev.last_tokens, seconds - prev.last_seconds
        acc_tokens, acc_seconds = prev.tokens, prev.seconds
    acc_tokens += d_tokens
    acc_seconds += d_seconds
    if acc_seconds > window_s:
        # Keep the most recent window_s seconds of work: scale the older part away.
        keep = window_s / acc_seconds
        acc_tokens, acc_seconds = acc_tokens * keep, window_s
    return Learned(report.reported_at, tokens, seconds, acc_tokens, acc_seconds)


@dataclass
class PrefillRates:
    """Per-backend learned prefill rates across reports."""

    window_s: float = WINDOW_S
    min_tokens: float = MIN_TOKENS
    nodes: dict[str, Learned] = field(default_factory=dict)

    def observe(self, name: str, report: MemoryReport) -> None:
        prev = self.nodes.get(name, Learned())
        self.nodes[name] = next_learned(prev, report, self.window_s)

    def rate(self, name: str) -> float | None:
        """The learned rate (tokens/s per engine), or None: use the configured one."""
        learned = self.nodes.get(name)
        return learned.rate(self.min_tokens) if learned is not None else None

    def forget(self, name: str) -> None:
        self.nodes.pop(name, None)
