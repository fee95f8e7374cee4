"""The README's first quick-start command runs end to end (small and fast here)."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_and_compares_policies() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "demo",
            "--requests",
            "40",
            "--rate",
            "20",
            "--speedup",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "Same workload, same seed, same engines" in out
    assert "kvroute" in out and "round_robin" in out
    assert "the fleet at its most fragmented moment" in out
