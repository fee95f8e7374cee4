"""No function in proxy/ over 60 lines, no module over 400 (read with ``ast``, nothing imported).

A function longer than a screen does several jobs, and a reader who must change one of them
reads all of them; a module over 400 lines holds several concerns. The limits are the house
rule of docs/architecture.md; split by job, never by cutting at the limit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
# (path, qualname) of a function that truly cannot be split; none today.
ALLOWED_FUNCTIONS: frozenset[tuple[str, str]] = frozenset()
ALLOWED_MODULES: frozenset[str] = frozenset()


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualname, lines from ``def`` to its last line) of every function, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            assert node.end_lineno is not None
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, prefix + node.name + ".")


def sources() -> list[Path]:
    return sorted((ROOT / "proxy").rglob("*.py"))


def test_no_function_over_the_limit() -> None:
    over = []
    for path in sources():
        rel = str(path.relative_to(ROOT))
        for name, lines in functions(ast.parse(path.read_text(), rel)):
            if lines > MAX_FUNCTION_LINES and (rel, name) not in ALLOWED_FUNCTIONS:
                over.append(f"{rel} {name}: {lines} lines")
    assert not over, "\n".join(over)


def test_no_module_over_the_limit() -> None:
    over = []
    for path in sources():
        rel = str(path.relative_to(ROOT))
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES and rel not in ALLOWED_MODULES:
            over.append(f"{rel}: {lines} lines")
    assert not over, "\n".join(over)


def test_a_long_function_is_measured_from_def_to_its_last_line() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    source = f"class A:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    assert dict(functions(ast.parse(source))) == {"A.f": 62}
