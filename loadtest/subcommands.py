"""One dispatcher for ``python -m loadtest.bench`` and ``python -m loadtest.lab``: each
subcommand is a module of the package with a ``main(argv)``, imported only when run (a
benchmark's dependencies cost nothing to the others)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def dispatch(
    package: str,
    subcommands: Mapping[str, tuple[str, str]],
    usage: Callable[[], str],
    argv: Sequence[str] | None = None,
) -> int:
    """Run ``argv[0]``'s module (``package.<module>``) with the rest; help or 2 otherwise."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in subcommands:
        print(f"unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{package}.{subcommands[name][0]}")
    code = module.main(rest)
    return code if isinstance(code, int) else 0
