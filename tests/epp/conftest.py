"""Without the ``epp`` extra (grpcio, xds-protos) these tests are not collected, unless
``KVROUTE_REQUIRE_ENVOY`` is set (CI), where the missing extra fails the run."""

from __future__ import annotations

import importlib.util
import os


def _missing() -> list[str]:
    wanted = ("grpc", "grpc_health", "envoy.service.ext_proc.v3")
    missing = []
    for name in wanted:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


collect_ignore_glob = (
    ["test_*.py"] if _missing() and not os.environ.get("KVROUTE_REQUIRE_ENVOY") else []
)
