"""proxy.core.sample_gate: learning from answers at a bounded rate per key."""

from __future__ import annotations

from proxy.core.sample_gate import SampleGate


def test_the_first_burst_all_teach_then_at_most_the_rate() -> None:
    gate = SampleGate(per_s=10.0, burst=5.0)
    assert [gate.take("m", 0.0) for _ in range(7)] == [True] * 5 + [False, False]
    # 1,000 answers over the next second: 10 refills, not 1,000 samples.
    taken = sum(gate.take("m", i / 1000) for i in range(1, 1001))
    assert 9 <= taken <= 10


def test_keys_have_their_own_buckets() -> None:
    gate = SampleGate(per_s=1.0, burst=1.0)
    assert gate.take("a", 0.0) and not gate.take("a", 0.1)
    assert gate.take("b", 0.1)


def test_a_quiet_key_teaches_again_and_a_clock_set_back_drains_nothing() -> None:
    gate = SampleGate(per_s=2.0, burst=2.0)
    assert gate.take("m", 100.0) and gate.take("m", 100.0) and not gate.take("m", 100.0)
    assert gate.take("m", 100.5)
    assert not gate.take("m", 50.0)  # set back: no refill, and the bucket is not driven below 0
    assert gate.take("m", 50.5)


def test_the_table_of_keys_is_bounded() -> None:
    gate = SampleGate(per_s=1.0, burst=1.0, max_keys=3)
    for key in "abcdef":
        gate.take(key, 0.0)
    assert len(gate._buckets) <= 3
