"""The mutation list (tests/mutations/run.py) cannot go stale silently.

Every row must still name one function under ``proxy/`` whose source holds its pattern exactly
once, and guards that exist. A refactor that moves, renames or rewrites the code a mutation
breaks fails here, on every test run, instead of turning that row into one that tests nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

RUNNER = Path(__file__).resolve().parent / "mutations" / "run.py"


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvroute_mutations", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


runner = load_runner()
INDEX = runner.functions(runner.ROOT)


@pytest.mark.parametrize("mutation", runner.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_resolves_to_one_place_and_its_guards_exist(mutation: object) -> None:
    assert runner.stale(mutation, runner.ROOT, INDEX) == []


def test_a_stale_row_is_reported_not_skipped(tmp_path: Path) -> None:
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "a.py").write_text("def f():\n    return 1\n\ndef g():\n    return 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    index = runner.functions(tmp_path)
    ok = runner.Mutation("ok", "", ("tests/test_a.py::test_a",), "f", r"return 1", "return 2")
    assert runner.stale(ok, tmp_path, index) == []
    moved = runner.Mutation("moved", "", ("tests/test_a.py",), "h", r"return 1", "")
    assert runner.stale(moved, tmp_path, index)[0].startswith("STALE: no function")
    changed = runner.Mutation("changed", "", ("tests/test_a.py",), "f", r"return 3", "")
    assert "not found" in runner.stale(changed, tmp_path, index)[0]
    renamed = runner.Mutation("renamed", "", ("tests/test_a.py::test_b",), "f", r"return 1", "")
    assert runner.stale(renamed, tmp_path, index) == ["STALE: no test test_b in tests/test_a.py"]
    # Patched inside the anchor only: g's identical line stays.
    assert runner.apply(ok, tmp_path) is None
    assert (tmp_path / "proxy" / "a.py").read_text().count("return 1") == 1
