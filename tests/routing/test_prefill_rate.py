"""Pure rules: each backend's prefill rate learned from its own counters, and what ranks on it."""

from __future__ import annotations

from proxy.core.fleet import MemoryReport, NodeView, Overlay
from proxy.routing.prefill_rate import MIN_TOKENS, PrefillRates
from proxy.routing.queueing import QueueingSettings, Rates, rank_by_wait


def report(at: float, tokens: float, seconds: float, waiting: int = 4) -> MemoryReport:
    return MemoryReport(
        100_000,
        100_000,
        100_000,
        "paged",
        16,
        running=1,
        waiting=waiting,
        reported_at=at,
        queueing=True,
        prefill_tokens=tokens,
        prefill_seconds=seconds,
    )


def test_no_data_no_rate_then_the_rise_between_reports() -> None:
    rates = PrefillRates()
    rates.observe("a", report(1.0, 0.0, 0.0))
    assert rates.rate("a") is None  # not exported: the configured rate stands
    rates.observe("a", report(2.0, MIN_TOKENS / 2, 1.0))
    assert rates.rate("a") is None  # too little work behind it yet
    rates.observe("a", report(3.0, 4 * MIN_TOKENS, 2.0))
    assert rates.rate("a") == 4 * MIN_TOKENS / 2.0
    # The same report again changes nothing.
    rates.observe("a", report(3.0, 999_999.0, 2.5))
    assert rates.rate("a") == 4 * MIN_TOKENS / 2.0


def test_the_window_follows_a_rate_that_changed() -> None:
    rates = PrefillRates(window_s=10.0)
    rates.observe("a", report(1.0, 100_000.0, 10.0))  # 10k tokens/s so far
    assert rates.rate("a") == 10_000.0
    tokens, seconds = 100_000.0, 10.0
    for i in range(60):
        # The server slowed to 2k tokens/s (another model, longer prompts, a busy GPU).
        tokens, seconds = tokens + 2_000.0, seconds + 1.0
        rates.observe("a", report(2.0 + i, tokens, seconds))
    # Older work decays away (by window / (window + new work) per report): six windows on,
    # the old rate is under 1% of the estimate.
    rate = rates.rate("a")
    assert rate is not None and 2_000.0 <= rate < 2_100.0


def test_a_restart_starts_the_window_again() -> None:
    rates = PrefillRates()
    rates.observe("a", report(1.0, 500_000.0, 50.0))
    rates.observe("a", report(2.0, 30_000.0, 10.0))  # counters fell: a new process
    assert rates.rate("a") == 3_000.0


def node(name: str, waiting: int) -> NodeView:
    r = report(1.0, 0.0, 0.0, waiting=waiting)
    return NodeView(name, report=r, overlay=Overlay())


def test_ranking_uses_the_rate_it_is_given() -> None:
    # "slow" has the shorter queue, but prefills at a fifth of the speed.
    nodes = [node("fast", waiting=6), node("slow", waiting=3)]
    same = QueueingSettings(rates={"fast": Rates(10_000.0), "slow": Rates(10_000.0)})
    assert [n for n, _ in rank_by_wait(nodes, 500, 600, "short", same)] == ["slow", "fast"]
    learned = QueueingSettings(rates={"fast": Rates(10_000.0), "slow": Rates(2_000.0)})
    assert [n for n, _ in rank_by_wait(nodes, 500, 600, "short", learned)] == ["fast", "slow"]
