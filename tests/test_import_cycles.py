"""No import circle inside any package of proxy/, read from the source with ``ast``.

A circle means no module of it can be read, tested or moved without the others: the
gateway's steps once all imported ``walk.py`` (for the ``Gateway`` type) while ``walk.py``
imported them. Imports under ``TYPE_CHECKING`` count too: a circle that only the type
checker sees is still a circle for the reader. Between packages the layering test
(``test_layering.py``) already forbids any import that runs back up.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def packages() -> list[Path]:
    """Every package directory under proxy/ (proxy itself included)."""
    return sorted(p.parent for p in (ROOT / "proxy").rglob("__init__.py"))


def imported_names(path: Path, package: str) -> Iterator[str]:
    """Every module name an import statement of ``path`` may refer to, relative ones resolved."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, node.module] if node.module else parts)
            # ``from pkg import name``: ``name`` may be a module of pkg, else it is in pkg.
            yield from (f"{base}.{alias.name}" for alias in node.names)
            yield base


def graph_of(directory: Path) -> dict[str, set[str]]:
    """The imports between the modules directly inside one package."""
    modules = {module_name(p): p for p in sorted(directory.glob("*.py")) if p.name != "__init__.py"}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        seen_names = list(imported_names(path, name.rpartition(".")[0]))
        for imported in seen_names:
            target = imported if imported in modules else imported.rpartition(".")[0]
            if target in modules and target != name:
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def a_path_around(part: list[str], edges: dict[str, set[str]]) -> str:
    """The shortest circle through the part's first module, for the failure message."""
    start, members = part[0], set(part)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for nxt in sorted(edges[node] & members):
                if nxt == start:
                    trail = [node]
                    while trail[-1] != start:
                        trail.append(came_from[trail[-1]])
                    return " -> ".join([*reversed(trail), start])
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    return " -> ".join(part)


@pytest.mark.parametrize("directory", packages(), ids=lambda p: module_name(p / "__init__.py"))
def test_no_import_circle_inside_the_package(directory: Path) -> None:
    edges = graph_of(directory)
    found = cycles(edges)
    assert not found, "\n".join(
        f"circle of {len(part)}: {a_path_around(part, edges)}" for part in found
    )


def test_a_circle_is_found_and_named() -> None:
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles(edges) == [["p.a", "p.b", "p.c"]]
    assert a_path_around(["p.a", "p.b", "p.c"], edges) == "p.a -> p.b -> p.c -> p.a"


def test_type_checking_imports_count(tmp_path: Path) -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy.x.b import B\n"
    path = tmp_path / "a.py"
    path.write_text(source)
    assert "proxy.x.b" in set(imported_names(path, "proxy.x"))
