"""The do-no-harm verdicts on made-up rows (``loadtest.bench.do_no_harm_report``): pure."""

from __future__ import annotations

from typing import Any

from loadtest.bench.do_no_harm_cells import CELLS
from loadtest.bench.do_no_harm_report import FIGURES, summarise, verdicts


def row(router: str, run: int, **figures: float) -> dict[str, Any]:
    base = dict.fromkeys(FIGURES, 0.0) | {"failed": 0, "requests": 100}
    base |= {"short_ttft_p50": 0.1, "short_ttft_p99": 1.0, "ttft_p99": 2.0}
    return base | {"model": "v1", "cell": "overload", "router": router, "run": run} | figures


def overload(longest_holds: list[float]) -> dict[str, Any]:
    rows = []
    for run, held in enumerate(longest_holds, start=1):
        rows.append(row("kvroute", run, longest_hold_s=held))
        rows.append(row("power_of_two", run, ttft_p99=4.0))
        rows.append(row("cache_aware", run, ttft_p99=3.0))
    (result,) = verdicts(summarise(rows), CELLS)
    return result


def check(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in result["checks"] if c["check"] == name)


def test_at_overload_no_hold_may_outlast_the_best_peers_ttft_p99_in_any_run() -> None:
    name = "longest hold / best peer's TTFT p99"
    ok = overload([1.0, 2.9, 0.5])
    assert check(ok, name)["ok"] is True and ok["verdict"] == "PASS"
    # One run's longest hold (3.3 s) outlasts that run's best peer p99 (3.0 s): the median
    # of the runs would hide it.
    bad = overload([1.0, 3.3, 0.5])
    got = check(bad, name)
    assert got["ok"] is False and abs(got["value"] - 1.1) < 1e-9
    assert bad["verdict"] == "FAIL"
