"""The README's first quick-start command runs end to end (small and fast here) and makes its point."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def test_demo_runs_and_kvroute_does_better(tmp_path: Path) -> None:
    totals = tmp_path / "demo.json"
    # Small engines and a brisk rate, so round robin fragments them within seconds. Speedup 25,
    # not more: requests must overlap for memory to fragment, and on a loaded machine the
    # driver's arrivals lag; at 50 both policies once saw just 2 wasted attempts (no point made).
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
            "25",
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
    # The most fragmented moment says how many failed by then and by the end, which agree.
    assert re.search(r"had failed by then, \d+ by the end of the run", out)
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


def test_a_higher_kvroute_p99_is_explained_by_the_documents_it_answered() -> None:
    from loadtest.bench.driver import Result, RunStats
    from loadtest.demo import latency_note

    def run(doc_status: int) -> RunStats:
        chats = [Result("short", 100, 200, 0.5) for _ in range(98)]
        return RunStats(chats + [Result("long", 30_000, doc_status, 9.0) for _ in range(2)])

    # Round robin failed both documents: its percentiles hold only the fast chats.
    note = latency_note(
        [
            ("kvroute", run(200), {}),
            ("round_robin", run(503), {}),
        ]
    )
    assert note.startswith("latency: kvroute's p99 is higher (9.00 s vs 0.50 s)")
    assert "kvroute answered 2 documents, round_robin 0" in note
    assert latency_note([("kvroute", run(200), {}), ("round_robin", run(200), {})]) == ""
