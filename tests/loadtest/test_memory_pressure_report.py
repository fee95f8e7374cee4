"""The memory-pressure report's verdicts: run by run, and each workload's runs together."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench.memory_pressure_report import main, targets, targets_over_runs


def row(
    run: int,
    policy: str,
    goodput: float,
    preemptions: int = 0,
    short: float | None = 0.1,
    long_: float | None = 1.0,
    failed: int = 0,
    workload: str = "bimodal-high",
) -> dict[str, Any]:
    return {
        "workload": workload,
        "run": run,
        "policy": policy,
        "failed": failed,
        "requests": 100,
        "goodput_ceiling": 2000,
        "last_ttft_s": 0.5,
        "preemptions": preemptions,
        "goodput_tokens_per_s": goodput,
        "short_ttft_p99": short,
        "long_ttft_p99": long_,
        "mean_end_s": 9.0,
    }


def verdicts(line: str) -> dict[str, bool]:
    body = line.split(": ", 1)[1]
    out = {}
    for part in body.split(", "):
        name, _, word = part.rpartition(": ")
        out[name.split(" (")[0]] = word == "yes"
    return out


def test_one_late_run_misses_goodput_there_but_not_over_the_runs() -> None:
    rows = [
        row(1, "kvroute", 970), row(1, "peer", 1000, preemptions=5, short=4.0, long_=6.0),
        row(2, "kvroute", 1300), row(2, "peer", 1000, preemptions=3, short=4.0, long_=6.0),
    ]  # fmt: skip
    per_run = [verdicts(line) for line in targets(rows)]
    assert [v["goodput >= best peer"] for v in per_run] == [False, True]
    (together,) = targets_over_runs(rows)
    assert together.startswith("bimodal-high, runs 1-2 together")
    got = verdicts(together)
    assert got == {
        "0 failed": True,
        "preemptions <= 20% best peer in every run": True,
        "goodput >= best peer": True,
        "short p99 lowest": True,
        "long p99 <= 1.2x best": True,
    }
    assert "(1135.0 vs 1000.0 tok/s)" in together


def test_over_the_runs_each_target_can_fail() -> None:
    rows = [
        # Less goodput on the mean, a failure, slower short requests, slower long ones, and
        # one run where the best peer preempted nothing while kvroute preempted once.
        row(1, "kvroute", 900, preemptions=1, short=0.5, long_=2.0, failed=1),
        row(1, "a", 1000, preemptions=0, short=0.2, long_=1.0),
        row(1, "b", 950, preemptions=4, short=0.3, long_=1.5),
        row(2, "kvroute", 1000, short=0.5, long_=2.0),
        row(2, "a", 1000, preemptions=2, short=0.2, long_=1.0),
        row(2, "b", 950, preemptions=4, short=0.3, long_=1.5),
    ]
    (together,) = targets_over_runs(rows)
    assert not any(verdicts(together).values()), together


def test_a_missing_figure_counts_against_its_router() -> None:
    rows = [
        row(1, "kvroute", 1000, short=None),
        row(1, "peer", 900, preemptions=2, short=5.0),
    ]
    (together,) = targets_over_runs(rows)
    assert verdicts(together)["short p99 lowest"] is False


def test_a_workload_with_a_missing_row_is_not_judged() -> None:
    rows = [
        row(1, "kvroute", 1000), row(1, "peer", 900, preemptions=2),
        row(2, "kvroute", 1000),  # the peer's run 2 was skipped (its fleet did not start)
        row(1, "kvroute", 500, workload="trace"), row(1, "peer", 400, preemptions=1, workload="trace"),
    ]  # fmt: skip
    lines = targets_over_runs(rows)
    assert [line.split(",")[0] for line in lines] == ["trace"]


def test_saved_runs_are_judged_again_from_their_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "runs-1.json", tmp_path / "runs-2.json"
    first.write_text(json.dumps([row(1, "kvroute", 970), row(1, "peer", 1000, preemptions=5)]))
    second.write_text(json.dumps([row(2, "kvroute", 1300), row(2, "peer", 1000, preemptions=3)]))
    assert main([str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "bimodal-high run 1: " in out and "bimodal-high run 2: " in out
    assert "bimodal-high, runs 1-2 together: " in out
    assert "goodput >= best peer (1135.0 vs 1000.0 tok/s): yes" in out
