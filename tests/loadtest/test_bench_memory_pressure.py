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
    argv += ["--duration", "2", "--workloads", "bimodal-low,trace"]
    argv += ["--policies", "kvroute,round_robin", "--json", str(out_json), "--plot", str(out_png)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=500, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads(out_json.read_text())
    assert [(r["workload"], r["policy"]) for r in rows] == [
        ("bimodal-low", "kvroute"),
        ("bimodal-low", "round_robin"),
        ("trace", "kvroute"),
        ("trace", "round_robin"),
    ]
    for r in rows:
        assert r["requests"] > 0 and r["failed"] == 0, r
        assert r["goodput_tokens_per_s"] > 0 and r["preemptions"] >= 0 and r["timeline"]
    assert "bimodal-low run 1:" in out.stdout and out_png.stat().st_size > 0
