"""``python -m loadtest.bench do-no-harm`` end to end on one tiny cell: real engines, real routers.

One run of the ``smoke`` cell (5 s of arrivals, classic engines) through kvroute, and through
vllm-router's ``power_of_two`` where it is installed; the JSON must hold every figure the
verdicts read, and kvroute must fail nothing. Timings are printed, never asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.bench import do_no_harm
from loadtest.bench.do_no_harm_report import FIGURES
from loadtest.bench.overhead_targets import find_vllm_router


@pytest.mark.timeout(120)
def test_one_tiny_cell_gives_every_figure_and_kvroute_fails_nothing(tmp_path: Path) -> None:
    routers = "kvroute,power_of_two" if find_vllm_router(None) else "kvroute"
    out = tmp_path / "dnh.json"
    argv = ["--cells", "smoke", "--runs", "1", "--duration", "5", "--engine-models", "classic"]
    assert do_no_harm.main([*argv, "--routers", routers, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert {r["router"] for r in got["runs"]} == set(routers.split(","))
    kv = next(r for r in got["runs"] if r["router"] == "kvroute")
    assert kv["requests"] > 0 and kv["failed"] == 0
    assert set(FIGURES) <= set(kv)  # kvroute's rows carry its hold figures too
    (cell,) = got["cells"]
    assert (cell["model"], cell["cell"]) == ("classic", "smoke")
    assert cell["verdict"] in ("PASS", "FAIL", "INCOMPLETE")
    assert cell["checks"][0] == {"check": "kvroute failed", "value": 0, "limit": 0, "ok": True}
