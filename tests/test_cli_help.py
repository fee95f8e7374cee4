"""Every ``--help`` prints its help: ``kvroute``, each of its subcommands, ``python -m
loadtest.bench`` and each benchmark.

argparse expands ``%`` in help strings, so a bare one ("70% chat") makes ``--help`` raise
instead of printing (``kvroute --help`` did). The subcommands are read from the parser and
from the benchmarks' table, so one added later is checked without editing this file. The
checks run in this process (fast); one runs the installed ``kvroute`` script for real.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from loadtest.bench import __main__ as bench
from proxy import cli

ROOT = Path(__file__).resolve().parent.parent


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    """The subcommands of ``parser``, as argparse holds them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def help_of(
    main: Callable[[Sequence[str]], int | None],
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> str:
    """What ``main(argv)`` prints to stdout; it must end with exit status 0."""
    code: object
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's --help exits
        code = exc.code
    out, err = capsys.readouterr()
    assert code in (0, None), f"{argv}: exit {code!r}\n{err}"
    return out


KVROUTE_SUBCOMMANDS = subcommands(cli.build_parser())


def test_the_subcommands_are_found() -> None:
    assert {"serve", "check-config", "engine", "demo"} <= set(KVROUTE_SUBCOMMANDS)
    assert {"overhead", "compare", "locust"} <= set(bench.SUBCOMMANDS)


def test_kvroute_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.build_parser().format_help().startswith("usage: kvroute")
    out = help_of(cli.main, ["--help"], capsys)
    assert out.startswith("usage: kvroute")
    for name in KVROUTE_SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", KVROUTE_SUBCOMMANDS)
def test_kvroute_subcommand_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The delegated subcommands (engine, demo, ...) hand --help to their own module's parser.
    out = help_of(cli.main, [name, "--help"], capsys)
    assert out.startswith("usage:"), out[:200]
    assert "--help" in out


def test_bench_help(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of(bench.main, ["--help"], capsys)
    assert out.startswith("usage: python -m loadtest.bench")
    for name in bench.SUBCOMMANDS:
        assert f"  {name} " in out


#: Imported, these patch the whole process (gevent's monkey.patch_all: ssl, sockets, threads),
#: which would break the tests that run after them in it.
PROCESS_PATCHERS = frozenset({"gevent", "locust"})


def patches_the_process(name: str) -> bool:
    """Whether the benchmark's module imports gevent or locust (then its --help runs apart)."""
    path = ROOT / "loadtest" / "bench" / f"{bench.SUBCOMMANDS[name][0]}.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
        else:
            continue
        if any(m.partition(".")[0] in PROCESS_PATCHERS for m in modules):
            return True
    return False


@pytest.mark.parametrize("name", list(bench.SUBCOMMANDS))
def test_benchmark_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    if patches_the_process(name):
        done = subprocess.run(
            [sys.executable, "-m", "loadtest.bench", name, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        out = done.stdout
    else:
        out = help_of(bench.main, [name, "--help"], capsys)
    assert "usage:" in out, out[:200]


def test_locust_is_kept_out_of_this_process() -> None:
    assert patches_the_process("locust")
    assert not patches_the_process("overhead")


def kvroute_script() -> str | None:
    """The installed console script: beside this interpreter (a venv), else on PATH."""
    beside = Path(sys.executable).parent / "kvroute"
    return str(beside) if beside.exists() else shutil.which("kvroute")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]], ids=" ".join)
def test_kvroute_help_in_a_real_process(argv: list[str]) -> None:
    script = kvroute_script()
    if script is None:
        pytest.skip("kvroute is not installed (pip install -e .)")
    done = subprocess.run(
        [script, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvroute"), done.stdout[:200]


def test_bench_help_in_a_real_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m loadtest.bench")


#: ``%`` as argparse reads a help string: ``%%``, or a named field such as ``%(default)s``.
ARGPARSE_PERCENT = re.compile(r"%%|%\(\w+\)[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]")


def bare_percents(top: Path, root: Path = ROOT) -> list[str]:
    """``help=`` strings (and their f-string parts) under ``top`` with a ``%`` argparse would
    misread, wherever the parser is built: also those no subcommand above reaches."""
    found = []
    for path in sorted(top.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.keyword) or node.arg != "help":
                continue
            for part in ast.walk(node.value):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    if "%" in ARGPARSE_PERCENT.sub("", part.value):
                        rel = path.relative_to(root)
                        found.append(f"{rel}:{part.lineno}: {part.value!r}")
    return found


@pytest.mark.parametrize("top", ["proxy", "loadtest"])
def test_no_bare_percent_in_a_help_string(top: str) -> None:
    assert bare_percents(ROOT / top) == []


def test_a_bare_percent_is_found(tmp_path: Path) -> None:
    ok = 'p.add_argument("--a", help="10%% of %(default)s")\n'
    bad = 'p.add_argument("--b", help=f"{x} 70% chat")\n'
    (tmp_path / "m.py").write_text(ok + bad)
    assert bare_percents(tmp_path, tmp_path) == ["m.py:2: ' 70% chat'"]
    # What the check stands for: argparse cannot render such a help string.
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--b", help="70% chat")
    with pytest.raises((TypeError, ValueError)):
        parser.format_help()
