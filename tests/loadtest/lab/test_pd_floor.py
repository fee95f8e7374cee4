"""The offline floor on a decode server's wait with no preemption (loadtest.lab.pd_floor).

Small lists whose best schedule is known by hand: the floor never passes it, and is below it
by at most a grid step per request in the chain of waits, plus one (the module's docstring).
"""

from __future__ import annotations

import pytest

from loadtest.lab.pd_floor import DecodeFleet, feasible, main, wait_floor
from loadtest.workload import Request

DT = 0.02
# 100 tokens a second per request; one server of 1,000 tokens.
ONE = DecodeFleet(servers=1, capacity_tokens=1_000, decode_tps=100.0)


def test_two_requests_that_cannot_share_a_server_wait_for_the_shorter_one() -> None:
    # Both arrive at 0 with 500-token prompts: together they overflow on their first token.
    # Best: the 1 s one first, the 4 s one waits 1 s (the other way round it waits 4 s).
    requests = [Request(0.0, 500, 400), Request(0.0, 500, 100)]
    floor = wait_floor(requests, ONE, DT)
    assert 1.0 - 3 * DT <= floor <= 1.0
    assert not feasible(requests, ONE, 0.5, DT)
    assert feasible(requests, ONE, 1.0, DT)


def test_a_second_server_removes_the_wait() -> None:
    requests = [Request(0.0, 500, 400), Request(0.0, 500, 100)]
    assert wait_floor(requests, DecodeFleet(2, 1_000, 100.0), DT) == 0.0


def test_requests_that_fit_together_never_wait() -> None:
    requests = [Request(0.0, 200, 200), Request(0.1, 300, 300)]  # 400 + 600 at most
    assert wait_floor(requests, ONE, DT) == 0.0


def test_slots_bound_the_running_requests_as_kv_does() -> None:
    # Tiny requests, one slot: the third waits for two 0.5 s answers.
    requests = [Request(0.0, 10, 50) for _ in range(3)]
    one_slot = DecodeFleet(servers=1, capacity_tokens=10_000, decode_tps=100.0, max_num_seqs=1)
    floor = wait_floor(requests, one_slot, DT)
    assert 1.0 - 4 * DT <= floor <= 1.0


def test_growth_counts_not_only_the_prompt() -> None:
    # 600 + 600 fit at the start; by 0.5 s they would hold 1,200: one waits for the other.
    requests = [Request(0.0, 600, 100), Request(0.0, 600, 100)]
    assert 1.0 - 3 * DT <= wait_floor(requests, ONE, DT) <= 1.0


def test_exempt_requests_may_wait_as_long_as_they_need() -> None:
    # Three requests that each need the server alone for 1 s: the last waits 2 s, unless it
    # is the one the p99 may leave out; then the second's 1 s is the floor.
    requests = [Request(0.0, 900, 100) for _ in range(3)]
    dt = 0.05  # three alike requests: the solver tries their orders, a coarser grid is quicker
    assert 2.0 - 4 * dt <= wait_floor(requests, ONE, dt) <= 2.0
    assert 1.0 - 3 * dt <= wait_floor(requests, ONE, dt, exceed=1) <= 1.0


def test_the_command_reads_the_pd_benchmarks_request_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Two seconds of the benchmark's mix: the wiring, not a hard instance.
    argv = ["--duration", "2", "--rate", "2", "--seeds", "7,8", "--time-limit", "10"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["seed 7", "seed 8"]
    for line in lines:
        assert float(line.split("at least ")[1].split(" s")[0]) >= 0, line
