"""No import circle inside any package of proxy/ or loadtest/, nor across loadtest/, read
from the source with ``ast``.

A circle means no module of it can be read, tested or moved without the others: the
gateway's steps once all imported ``walk.py`` (for the ``Gateway`` type) while ``walk.py``
imported them. Imports under ``TYPE_CHECKING`` count too, and so do imports inside a
function: a circle that only the type checker sees, or that a lazy import hides from the
interpreter, is still a circle for the reader. Between proxy/'s packages the layering test
(``test_layering.py``) already forbids any import that runs back up; loadtest/ has no layers,
so its circles are also looked for across its packages (``loadtest.engine.cli`` ->
``loadtest.engine.behaviours`` -> ... -> ``loadtest.engine.cli`` was one).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def packages(top: str = "proxy") -> list[Path]:
    """Every package directory under ``top`` (``top`` itself included)."""
    return sorted(p.parent for p in (ROOT / top).rglob("__init__.py"))


def import_statements(path: Path, package: str) -> Iterator[tuple[str, list[str]]]:
    """Each import of ``path`` as (module, names): ``import a.b`` is ("a.b", []), ``from a
    import b, c`` is ("a", ["b", "c"]); relative modules resolved against ``package``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, node.module] if node.module else parts)
            yield base, [alias.name for alias in node.names]


def imported_names(path: Path, package: str) -> Iterator[str]:
    """Every module name an import statement of ``path`` may refer to, relative ones resolved."""
    for base, names in import_statements(path, package):
        # ``from pkg import name``: ``name`` may be a module of pkg, else it is in pkg.
        yield from (f"{base}.{name}" for name in names)
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


def tree_graph(top: Path) -> dict[str, set[str]]:
    """The imports between all the modules under the package ``top``, ``__init__``s included.

    ``from pkg import name`` runs to the module ``pkg.name`` when there is one, else to
    ``pkg`` itself (its ``__init__``, which runs whatever it imports). The parent packages
    that Python imports first on the way to a module are not counted: every package whose
    ``__init__`` gathers its modules' names would be a circle with each of them.
    """
    modules = {module_name(p, top.parent): p for p in sorted(top.rglob("*.py"))}
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for base, names in import_statements(path, package):
            targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names]
            for target in targets or [base]:
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


def described(found: list[list[str]], edges: dict[str, set[str]]) -> str:
    return "\n".join(f"circle of {len(part)}: {a_path_around(part, edges)}" for part in found)


@pytest.mark.parametrize(
    "directory",
    packages("proxy") + packages("loadtest"),
    ids=lambda p: module_name(p / "__init__.py"),
)
def test_no_import_circle_inside_the_package(directory: Path) -> None:
    edges = graph_of(directory)
    found = cycles(edges)
    assert not found, described(found, edges)


def test_no_import_circle_across_loadtest() -> None:
    edges = tree_graph(ROOT / "loadtest")
    assert "loadtest.engine.behaviours.server" in edges["loadtest.engine.behaviours"]
    found = cycles(edges)
    assert not found, described(found, edges)


def test_a_circle_is_found_and_named() -> None:
    edges = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles(edges) == [["p.a", "p.b", "p.c"]]
    assert a_path_around(["p.a", "p.b", "p.c"], edges) == "p.a -> p.b -> p.c -> p.a"


def test_type_checking_imports_count(tmp_path: Path) -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proxy.x.b import B\n"
    path = tmp_path / "a.py"
    path.write_text(source)
    assert "proxy.x.b" in set(imported_names(path, "proxy.x"))


def test_tree_graph_follows_a_package_to_its_module_or_its_init(tmp_path: Path) -> None:
    """``from pkg import mod`` reaches ``pkg.mod``; ``from pkg import Name`` reaches pkg's init."""
    pkg = tmp_path / "lt" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "lt" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from lt.pkg.b import B\n")
    (pkg / "a.py").write_text("def f() -> None:\n    from lt.pkg import b, B\n")
    (pkg / "b.py").write_text("from . import a\nB = 1\n")
    edges = tree_graph(tmp_path / "lt")
    assert edges["lt.pkg.a"] == {"lt.pkg.b", "lt.pkg"}
    assert edges["lt.pkg"] == {"lt.pkg.b"}
    assert cycles(edges) == [["lt.pkg", "lt.pkg.a", "lt.pkg.b"]]
