"""The simulated engine's entry: ``python -m loadtest.engine.server`` runs its command line.

The serving itself (``AppServer``, ``EngineServer``, ``serve``, ``run``) is in
``loadtest.engine.serving``, the command line in ``loadtest.engine.cli``; the names tests
and tools import from here stay importable here. Nothing in the engine imports this module,
so it may import both without a circle.
"""

from __future__ import annotations

import sys

from loadtest.engine.cli import add_arguments, main, run_from_args
from loadtest.engine.handlers import Engine, build_app
from loadtest.engine.model import EngineConfig
from loadtest.engine.serving import AppServer, EngineServer, run, serve, serve_until_stopped

__all__ = [
    "AppServer",
    "Engine",
    "EngineConfig",
    "EngineServer",
    "add_arguments",
    "build_app",
    "main",
    "run",
    "run_from_args",
    "serve",
    "serve_until_stopped",
]


if __name__ == "__main__":
    sys.exit(main())
