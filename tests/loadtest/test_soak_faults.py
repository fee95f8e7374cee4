"""The fault soak's report (loadtest.bench.soak_faults): what a window says, read without a fleet."""

from __future__ import annotations

from collections import Counter

from loadtest.bench.soak_faults import FAULTS, Window, percentile, window_json


def test_ttft_percentiles_leave_out_the_30_s_after_each_fault() -> None:
    w = Window(answered=5, failures=Counter({"killed_replica": 2}), faults=["60s replica"])
    # Sent at 10, 20 (calm), 65 and 89 (within 30 s of the fault at 60), 95 (calm again).
    w.ttft = [(10.0, 0.1), (20.0, 0.2), (65.0, 9.0), (89.0, 8.0), (95.0, 0.3)]
    got = window_json(w, fault_times=[60.0])
    assert got["ttft_samples_outside_faults"] == 3
    assert (got["ttft_p50_s"], got["ttft_p99_s"]) == (0.2, 0.3)
    assert got["failures"] == {"killed_replica": 2} and got["answered"] == 5


def test_percentile_and_the_fault_cycle() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(100)], 0.99) == 99.0
    assert FAULTS == ("replica", "redis", "engine", "reload", "disconnects")
