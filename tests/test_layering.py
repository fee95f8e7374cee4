"""The import direction of STYLE.md, checked on the source with ``ast`` (nothing is imported).

    cli -> api -> (ops, gateway, backends) -> (upstream, state) -> routing -> core
        -> config, errors, tasks

A module may import its own package and anything in a lower layer, never a higher layer or a
sibling of the same layer. ``routing`` and ``core`` import no asyncio, aiohttp, redis or httpx;
the simulator reaches only ``routing``, ``core`` and the config; nothing imports the app
except the CLI.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Rank of each part of proxy/: higher may import lower, never the other way.
LAYERS: dict[str, int] = {
    "proxy.errors": 0,
    "proxy.tasks": 0,
    "proxy.config": 1,
    "proxy.config_errors": 0,
    "proxy.core": 2,
    "proxy.routing": 3,
    "proxy.upstream": 4,
    "proxy.state": 4,
    "proxy.ops": 5,
    "proxy.gateway": 5,
    "proxy.backends": 5,
    "proxy.api": 6,
    # The endpoint picker: one more door into the walk, beside the app it runs in.
    "proxy.epp": 7,
    "proxy.cli": 8,
}
PURE = ("proxy.routing", "proxy.core")
IO_LIBRARIES = frozenset({"asyncio", "aiohttp", "redis", "httpx"})
# What the simulator may reach of proxy/ (config imports errors).
SIMULATOR_MAY_USE = ("proxy.routing", "proxy.core", "proxy.config", "proxy.errors")
APP = "proxy.api.app"
# Harnesses that build the gateway app in-process on purpose (the overhead benchmark measures
# the app itself under other server stacks), like the tests do.
APP_IMPORTERS = frozenset(
    {
        "proxy.cli",
        "proxy.epp.main",
        "loadtest.bench.overhead",
        "loadtest.bench.overhead_decision",
    }
)

# Known violations, each to be removed by the change that fixes it (none now: the asyncio
# part of proxy/core/tokens.py moved to proxy/gateway/sizing.py).
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # "from proxy import x" may name a module: count it as one.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return frozenset(found)


def part_of(module: str) -> str | None:
    """The layer key of a proxy module (``proxy.gateway.walk`` -> ``proxy.gateway``)."""
    for key in sorted(LAYERS, key=len, reverse=True):
        if module == key or module.startswith(key + "."):
            return key
    return None


def own_modules() -> set[str]:
    return {module_name(p) for p in source_files("proxy", "loadtest")}


def resolve(imported: str, known: set[str]) -> str | None:
    """The project module an import refers to (``from a.b import c`` may be a name in a.b)."""
    candidate = imported
    while candidate:
        if candidate in known:
            return candidate
        candidate = candidate.rpartition(".")[0]
    return None


def proxy_edges() -> Iterator[tuple[str, str]]:
    known = own_modules()
    for path in source_files("proxy"):
        source = module_name(path)
        if source == "proxy":
            # The package facade: lazy re-exports of the public API (see proxy/__init__.py).
            continue
        for imported in imports_of(path):
            yield (
                source,
                imported
                if imported.split(".")[0] in IO_LIBRARIES
                else (resolve(imported, known) or imported),
            )


def test_every_part_of_proxy_has_a_layer() -> None:
    for path in source_files("proxy"):
        name = module_name(path)
        assert name == "proxy" or part_of(name) is not None, f"{name} belongs to no layer"


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for source, target in proxy_edges():
        src, dst = part_of(source), part_of(target)
        if src is None or dst is None or src == dst or (source, target) in ALLOWED:
            continue
        if LAYERS[dst] >= LAYERS[src]:
            wrong.append(f"{source} imports {target} ({src} may not depend on {dst})")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_routing_and_core_do_no_io() -> None:
    wrong = []
    for source, target in proxy_edges():
        top = target.split(".")[0]
        if source.startswith(PURE) and top in IO_LIBRARIES and (source, top) not in ALLOWED:
            wrong.append(f"{source} imports {top}")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_app_but_the_cli() -> None:
    known = own_modules()
    wrong = [
        module_name(path)
        for path in source_files("proxy", "loadtest")
        if module_name(path) not in APP_IMPORTERS
        and any(resolve(i, known) == APP for i in imports_of(path))
    ]
    assert not wrong, f"{wrong} import {APP}"


def test_the_simulator_reaches_only_routing_core_and_config() -> None:
    """Transitively: whatever loadtest/sim imports, and what that imports, stays pure."""
    known = own_modules()
    paths = {module_name(p): p for p in source_files("proxy", "loadtest")}
    seen: set[str] = set()
    todo = [module_name(p) for p in source_files("loadtest/sim")]
    wrong: list[str] = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for imported in imports_of(paths[module]):
            if imported.split(".")[0] in IO_LIBRARIES:
                wrong.append(f"{module} imports {imported}")
                continue
            target = resolve(imported, known)
            if target is None or target in seen:
                continue
            if target.startswith("proxy") and not target.startswith(SIMULATOR_MAY_USE):
                if target != "proxy":
                    wrong.append(f"{module} imports {target}")
                continue
            todo.append(target)
    assert not wrong, "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize(
    ("source", "imported", "ok"),
    [
        ("proxy.gateway.walk", "proxy.routing.policy", True),
        ("proxy.routing.policy", "proxy.gateway.walk", False),
        ("proxy.gateway.walk", "proxy.ops.maintenance", False),
        ("proxy.config", "proxy.errors", True),
        ("proxy.core.fleet", "proxy.state.base", False),
    ],
)
def test_the_rule_itself(source: str, imported: str, ok: bool) -> None:
    """The checker tells a downward import from an upward or sideways one."""
    src, dst = part_of(source), part_of(imported)
    assert src is not None and dst is not None
    assert (src == dst or LAYERS[dst] < LAYERS[src]) is ok


def test_the_pure_parts_load_no_io_stack_at_run_time() -> None:
    """What the source says, the interpreter confirms: nothing pulls an I/O library in."""
    code = (
        "import sys\n"
        "import proxy.routing, proxy.core.fleet, proxy.errors, loadtest.sim.engine\n"
        "tops = {m.split('.')[0] for m in sys.modules}\n"
        "print(sorted(tops & {'asyncio', 'aiohttp', 'redis', 'httpx', 'starlette'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
