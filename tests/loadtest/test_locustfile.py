"""A short headless locust run of loadtest/bench/locustfile.py against a tiny real fleet.

Two simulated engines (one long pool, one general) behind the real gateway. The general
engine answers every inference with HTTP 500, so short requests are diverted to the long
pool (x-kvroute-attempts 2); prompts above the engines' capacity get the gateway's 400
``context_length_exceeded``. The run must send requests and record both in the custom
KVROUTE rows and the summary file.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.local_fleet import EngineSpec, LocalFleet

ROOT = Path(__file__).resolve().parents[2]
# A run of a fixed size (--kv-stop-after), bounded by -t: seconds on a quiet machine, longer
# on a loaded one (a 4 s timed run once finished no request there).
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fleet() -> Iterator[LocalFleet]:
    specs = [
        EngineSpec("long-0", "long", capacity_tokens=20_000, speedup=200.0),
        EngineSpec("general-0", "general", capacity_tokens=20_000, speedup=200.0),
    ]
    with LocalFleet(specs) as f:
        general = f.engines[1]
        httpx.post(
            general.url + "/admin/fault", json={"mode": "error500", "scope": "inference"}, timeout=5
        ).raise_for_status()
        yield f


def test_headless_run_records_requests_and_causes(fleet: LocalFleet, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    argv = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "bench" / "locustfile.py"),
        "--headless", "-u", "6", "-r", "6", "-t", "200s", "--stop-timeout", "5", "--only-summary",
        "--kv-stop-after", "120",
        "--host", fleet.gateway_url, "--csv", str(tmp_path / "kv"), "--html", str(tmp_path / "kv.html"),
        "--kv-short-share", "0.5", "--kv-short-tokens", "20-200", "--kv-long-tokens", "21000-30000",
        "--kv-short-output", "4-16", "--kv-long-output", "16-64", "--kv-think-s", "0.05",
        "--kv-summary", str(summary),
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=260, cwd=ROOT, check=False)
    # locust exits 1 when any request failed; these runs always have (the 400s are on purpose)
    assert out.returncode in (0, 1), out.stderr[-2000:]

    with (tmp_path / "kv_stats.csv").open() as f:
        rows = list(csv.DictReader(f))
    posts = [r for r in rows if r["Type"] == "POST"]
    assert sum(int(r["Request Count"]) for r in posts) > 0
    assert any("stream" in r["Name"] for r in posts), "the streaming user never ran"
    custom = {r["Name"]: int(r["Request Count"]) for r in rows if r["Type"] == "KVROUTE"}
    assert custom.get("failure context_length_exceeded", 0) > 0, custom
    assert custom.get("diverted: 2 attempts", 0) > 0, custom
    assert (tmp_path / "kv.html").stat().st_size > 0

    # The CSV is written by a periodic greenlet: it must hold every request the run made,
    # not the state of up to a second before the run stopped.
    total = json.loads(summary.read_text())["total_requests"]
    aggregated = next(r for r in rows if r["Name"] == "Aggregated")
    assert int(aggregated["Request Count"]) == total

    counts = json.loads(summary.read_text())["counts"]
    assert counts.get("class short", 0) > 0
    assert counts.get("attempts 2", 0) > 0
    assert counts.get("retry sent back to a node that failed it", 0) == 0
