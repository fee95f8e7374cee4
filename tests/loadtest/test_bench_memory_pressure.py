"""Smoke run of the memory-pressure benchmark (tiny parameters), so it never rots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
# Minutes on a loaded 2-core machine (the run starts engines and a gateway): a bound on a hang.
pytestmark = pytest.mark.timeout(520)


def test_bench_memory_pressure_smoke(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "mp.json", tmp_path / "mp.png"
    argv = [sys.executable, "-m", "loadtest.bench.memory_pressure", "--runs", "1"]
    argv += ["--duration", "2", "--workloads", "bimodal-low,trace-x4"]
    # trace-x4 at a tenth of its size: the workload's path, not its load.
    argv += ["--trace-x4-scale", "1", "--trace-x4-rate", "4", "--trace-x4-capacity", "10000"]
    argv += ["--policies", "kvroute,round_robin", "--json", str(out_json), "--plot", str(out_png)]
    argv += ["--debug-trace", str(tmp_path / "trace")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=500, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads(out_json.read_text())
    assert [(r["workload"], r["policy"]) for r in rows] == [
        ("bimodal-low", "kvroute"),
        ("bimodal-low", "round_robin"),
        ("trace-x4", "kvroute"),
        ("trace-x4", "round_robin"),
    ]
    for r in rows:
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert r["goodput_tokens_per_s"] > 0 and r["preemptions"] >= 0 and r["timeline"]
        # The floor is one on real engines: no row's last answer comes before it.
        assert r["goodput_tokens_per_s"] <= r["goodput_ceiling"], r
        assert r["mean_end_s"] is not None and 0 < r["mean_end_s"] < r["floor_s"] * 10, r
        # Read from kvroute's own counter; the other routers have none.
        assert isinstance(r["handed_to_queue"], int) and r["handed_to_queue"] >= 0, r
    assert "bimodal-low run 1:" in out.stdout and out_png.stat().st_size > 0
    # The debug trace: one file per row, kvroute's with the gateway's projection in it.
    traces = sorted(p.name for p in (tmp_path / "trace").iterdir())
    assert traces == [
        "bimodal-low-12-kvroute.jsonl",
        "bimodal-low-12-round_robin.jsonl",
        "trace-x4-12-kvroute.jsonl",
        "trace-x4-12-round_robin.jsonl",
    ]
    first = json.loads((tmp_path / "trace" / traces[0]).read_text().splitlines()[-1])
    assert "projection" in first["e0"] and first["e2"]["engines"].keys() == {"0", "1"}
