"""The fault suite's shared fleet: started once per module, healed between scenarios."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.faults.harness import RESULTS, FaultFleet


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "faults: fault injection against real processes (tests/faults)"
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[FaultFleet]:
    f = FaultFleet()
    try:
        f.start()
    except BaseException:
        f.stop()
        raise
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="session", autouse=True)
def fault_report() -> Iterator[dict[str, dict[str, Any]]]:
    """Per-scenario counts: printed at the end (pytest -s) and written to $KVROUTE_FAULT_REPORT."""
    yield RESULTS
    if not RESULTS:
        return
    print("\nfault suite: per-scenario counts")
    for name, r in RESULTS.items():
        print(f"  {name:34s} " + " ".join(f"{k}={v}" for k, v in r.items()))
    path = os.environ.get("KVROUTE_FAULT_REPORT")
    if path:
        with open(path, "w") as fh:
            json.dump(RESULTS, fh, indent=2, default=str)
