"""The README's first quick-start command runs end to end (small and fast here) and makes its point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_kvroute_does_better(tmp_path: Path) -> None:
    totals = tmp_path / "demo.json"
    # Small engines and a brisk rate, so round robin fragments them within ~5 s per run.
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "demo",
            "--requests",
            "160",
            "--rate",
            "50",
            "--speedup",
            "50",
            "--capacity-tokens",
            "64000",
            "--json",
            str(totals),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # Rich wraps long lines at the console width; read the text as one line.
    out = " ".join(res.stdout.split())
    assert "Same workload, same seed, same engines" in out
    assert "the fleet at its most fragmented moment" in out
    assert "the long pool's largest free block was" in out
    # Piped (not a terminal): bars draw distinct characters per segment, with a legend.
    assert "bars: # used = free in the largest block" in out
    assert "70% short chats (20-500 prompt tokens), 30% documents of 15,000-30,000 tokens" in out
    assert "live status page at http://127.0.0.1:" in out
    assert "a few failures can move between runs" in out
    data = json.loads(totals.read_text())
    kv, rr = data["kvroute"], data["round_robin"]
    assert kv["requests"] == rr["requests"] == 160
    # What the demo claims: kvroute wastes fewer attempts and fails no more requests.
    wasted_kv = kv["engine_allocation_failures"] + kv["failed"]
    wasted_rr = rr["engine_allocation_failures"] + rr["failed"]
    assert wasted_kv < wasted_rr, data
    assert kv["failed"] <= rr["failed"], data
    conclusion = out[out.index("conclusion:") :]
    assert conclusion.startswith(f"conclusion: kvroute failed {kv['failed']}/160")
    assert "fewer wasted attempts" in conclusion


def test_demo_help_names_the_workload() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0
    assert "70% short chats" in res.stdout and "15,000-30,000 tokens" in res.stdout
    assert "exactly reproducible" in res.stdout
