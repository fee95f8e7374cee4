"""Without the ``epp`` extra (grpcio, xds-protos) these tests are not collected, unless
``KVROUTE_REQUIRE_ENVOY`` is set (CI), where the missing extra fails the run. The Envoy
tests' fixtures: Envoy required where a test file asks (skipped, or failed in CI, without it), and the taps
between Envoy and the engines, stopped after each test."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.support.epp import Tap


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


@pytest.fixture
def envoy_installed() -> None:
    """For the tests behind a real Envoy (``pytestmark``); the protocol's own tests need none."""
    # Imported here: without the extra nothing in this folder is collected.
    from tests.support.envoy import require_envoy

    require_envoy()


@pytest.fixture
def taps() -> Iterator[list[Tap]]:
    started: list[Tap] = []
    yield started
    for tap in started:
        tap.stop()
