"""The experiments of ``python -m loadtest.lab``: each runs with tiny parameters, prints its
help, and stays apart from the benchmarks (no module of ``loadtest.bench`` imports one)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(420)


def run_lab(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """An experiment as it is started: ``python -m loadtest.lab <subcommand> ...``."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.lab", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, f"loadtest.lab failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_the_lab_entry_lists_every_experiment_and_refuses_others() -> None:
    from loadtest.lab.__main__ import SUBCOMMANDS

    out = run_lab("--help").stdout
    assert out.startswith("usage: python -m loadtest.lab")
    for name in SUBCOMMANDS:
        assert f"  {name} " in out, out
    wrong = subprocess.run(
        [sys.executable, "-m", "loadtest.lab", "nope"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert wrong.returncode == 2 and "unknown subcommand 'nope'" in wrong.stderr


@pytest.mark.parametrize("name", ["pd-floor", "pd-online", "encode-pools", "store-forgotten", "ab"])
def test_each_experiment_prints_its_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from loadtest.lab.__main__ import SUBCOMMANDS, main

    assert name in SUBCOMMANDS
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m loadtest.lab {name}")


def test_every_experiment_is_documented_in_docs_lab() -> None:
    from loadtest.lab.__main__ import SUBCOMMANDS

    docs = "\n".join(p.read_text() for p in (ROOT / "docs" / "lab").glob("*.md"))
    for name in SUBCOMMANDS:
        assert f"python -m loadtest.lab {name}" in docs, name


def test_no_benchmark_imports_an_experiment() -> None:
    found = []
    for path in sorted((ROOT / "loadtest").rglob("*.py")):
        if path.is_relative_to(ROOT / "loadtest" / "lab"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("loadtest.lab")
            ]
    assert found == []


def test_encode_pools_smoke() -> None:
    out = run_lab("encode-pools", "--docs", "2", "--rounds", "1").stdout
    assert "serial" in out and "2 threads" in out and "2 processes" in out, out


def test_store_forgotten_smoke(tmp_path: Path) -> None:
    out_json = tmp_path / "forgotten.json"
    out = run_lab("store-forgotten", "--counts", "50", "--calls", "20", "--json", str(out_json))
    rows = json.loads(out_json.read_text())
    assert [r["forgotten"] for r in rows] == [0, 50]  # the baseline is always measured
    assert all(r["reserve_redis_us"] > 0 and r["read_p50_ms"] > 0 for r in rows), rows
    assert "x none" in out.stdout


def test_tree_ab_smoke() -> None:
    """Two checkouts (here the same one twice) measured in alternating rounds, paired ratio printed."""
    from loadtest.bench.overhead import find_wrk

    if find_wrk() is None:
        pytest.skip("wrk is not installed")
    args = ("--rounds", "1", "--duration", "1", "--concurrency", "2")
    out = run_lab("ab", str(ROOT), str(ROOT), *args).stdout
    rounds = [line for line in out.splitlines() if line[:2] in ("A ", "B ")]
    assert len(rounds) == 2, out
    assert all(line.endswith("errors 0") for line in rounds), out
    assert "paired B/A: req/s x" in out and "CPU per request x" in out


def test_each_side_of_an_ab_runs_its_own_tree_even_started_inside_another(tmp_path: Path) -> None:
    """``python -m`` puts the working directory first: run from inside a checkout, both
    gateways once ran that checkout, and an A/B compared a tree with itself."""
    from loadtest.lab.tree_ab import in_tree

    for side in ("here", "there"):
        (tmp_path / side / "kvroute_probe").mkdir(parents=True)
        (tmp_path / side / "kvroute_probe" / "__main__.py").write_text(
            f"import sys; print({side!r}, sys.argv[1:])"
        )
    argv = in_tree(tmp_path / "there", "kvroute_probe", "--port", "1")
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, cwd=tmp_path / "here", check=True
    )
    assert out.stdout.strip() == "there ['--port', '1']"
