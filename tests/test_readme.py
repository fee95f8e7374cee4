"""The README keeps its promises: short, its test command is CI's, its numbers are the
benchmark pages', its links resolve, no work diary, and its request examples run as written
against the gateway and the simulated engines of ``config/kvroute.yaml``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from loadtest.local_fleet import engine_proc, free_port, specs_from_config, wait_http
from proxy.config import parse_config
from tests.support.gateway import run_gateway

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Where measured numbers are stated in full, with how they were measured.
RESULT_PAGES = ("docs/benchmarks.md", "docs/simulator.md", "docs/results.md")
DIARY = re.compile(
    r"issue \d+|\bmorning\b|\bafternoon\b|\bthird pass\b|\bfourth pass\b|problem statement"
    r"|\b20\d\d-\d\d-\d\d\b",
    re.IGNORECASE,
)


def section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 300


def test_its_test_command_is_the_one_ci_runs() -> None:
    # On a fresh machine the quick start's second command is .ci/run (it installs what the
    # tests need); the pytest line it runs is the one the README names there and in
    # Development, for a machine already set up.
    quick = code_blocks(section(README, "Quick start"), "bash")[0]
    commands = [line.split("#", 1)[0].strip() for line in quick.splitlines() if line.strip()]
    assert commands[1] == "bash .ci/run", commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    marked = ci[ci.index("# The README's test command:") + 1]
    assert marked in quick
    development = code_blocks(section(README, "Development"), "bash")[0]
    assert marked in [line.split("#", 1)[0].strip() for line in development.splitlines()]


def test_its_numbers_are_the_measured_ones() -> None:
    """Every percentage, µs, ms, s and ratio of the Results section is stated on a results page."""
    pages = "\n".join((ROOT / p).read_text() for p in RESULT_PAGES)
    results = section(README, "Results")
    numbers = re.findall(r"\d[\d,.]*(?:%| µs| ms| s\b|×)", results)
    assert len(numbers) >= 8, numbers
    # Seconds sit in tables without their unit ("0.42 / 2.46"): the figure itself must appear.
    missing = [n for n in numbers if n.removesuffix(" s") not in pages]
    assert missing == [], f"in README's Results but on no results page: {missing}"
    # The counts in prose, each next to what it counts in docs/benchmarks.md.
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "| final failures | 19 (4.8%) | 0 |" in bench and "failed 19 (4.8%)" in results
    assert "| 81 | 0 |" in bench and "wasted 81 attempts" in results
    assert "0.42 / 2.46 | 0.46 / 4.24" in bench and "(4.24 vs 2.46 s)" in results
    assert "| router CPU per request, c=32, Redis store | 306 µs |" in bench
    assert "226 µs / 227 µs" in bench and "226 µs of CPU per request" in results
    assert "306 µs with\nRedis" in results or "306 µs with Redis" in results
    # The simulator's table: each policy's failure rate and replicas, as docs/results.md has them.
    sim = (ROOT / "docs" / "results.md").read_text()
    rows = re.findall(r"\| \**(\w+)\** \| \**([\d.]+%)\** \| \**(\d+)\** \|", results)
    assert [r[0] for r in rows] == ["kvroute", "round_robin"], rows
    for name, fail, replicas in rows:
        row = next(line for line in sim.splitlines() if re.match(rf"\| \**{name}\b", line))
        cells = [c.strip(" *") for c in row.strip("|").split("|")]
        assert (cells[1], cells[-1]) == (fail, replicas), (name, row)


def test_its_links_resolve() -> None:
    for target in re.findall(r"\]\(((?:docs/)[^)#\s]+)", README):
        assert (ROOT / target).exists(), target
    for page in DOCS:
        for target in re.findall(r"\]\(([a-z-]+\.md)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}"


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_no_work_diary(path: Path) -> None:
    found = [m.group(0) for m in DIARY.finditer(path.read_text())]
    assert found == [], f"{path.name}: say what was measured, on what, how to reproduce: {found}"


@contextmanager
def shipped_fleet() -> Iterator[str]:
    """The engines config/kvroute.yaml expects (on free ports) and the gateway: its URL."""
    with ExitStack() as stack:
        raw = yaml.safe_load((ROOT / "config" / "kvroute.yaml").read_text())
        wanted = specs_from_config(str(ROOT / "config" / "kvroute.yaml"), 10.0, 100_000)
        for backend, (spec, _) in zip(raw["backends"], wanted, strict=True):
            proc = engine_proc(spec, free_port())
            proc.start()
            stack.callback(proc.stop)
            wait_http(proc.url + "/health", proc=proc.popen)
            backend["url"] = proc.url
        raw.pop("listen", None)
        cfg = parse_config(raw, "config/kvroute.yaml", environ={})
        yield stack.enter_context(run_gateway(cfg))


def test_the_request_examples_run_as_written() -> None:
    requests = section(README, "Send a request")
    (curl,) = [b for b in code_blocks(requests, "bash") if b.startswith("curl")]
    (client,) = code_blocks(requests, "python")
    with shipped_fleet() as url:
        host = url.removeprefix("http://")
        if shutil.which("curl") is not None:
            out = subprocess.run(
                ["bash", "-c", curl.replace("127.0.0.1:8000", host)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            assert '"object":"chat.completion"' in out.stdout.replace(" ", ""), out.stdout
        out = subprocess.run(
            [sys.executable, "-c", client.replace("127.0.0.1:8000", host)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert out.returncode == 0, out.stderr
    text, usage = out.stdout.strip().splitlines()[-2:]
    assert text and re.fullmatch(r"\d+ prompt tokens", usage), out.stdout
