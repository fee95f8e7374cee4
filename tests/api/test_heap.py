"""``kvroute serve`` freezes the heap startup built (proxy.api.heap), so full collections
while serving skip it: before, each stopped the event loop ~45 ms (docs/benchmarks.md); and
it collects the young generation less often (~6% of a tiny request's CPU)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from proxy.api.heap import YOUNG_THRESHOLD
from tests.support.gateway import gateway_cfg, run_gateway


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()  # the rest of the test process collects as before
        gc.set_threshold(*threshold)


def test_a_started_gateway_has_frozen_its_startup_heap(
    unfrozen: None, engine_factory: Callable[..., Any]
) -> None:
    engine = engine_factory(name="a")
    cfg = gateway_cfg([{"name": "a", "url": engine.url, "kind": "contiguous"}])
    default = gc.get_threshold()
    with run_gateway(cfg, freeze_heap=True) as url:
        frozen = gc.get_freeze_count()
        # The app, its config, metrics and routing tables, and every module loaded so far.
        assert frozen > 10_000, frozen
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 200
        # Serving freezes nothing more (frozen objects freed by their reference count leave
        # the count): what requests leave stays collectable.
        assert gc.get_freeze_count() <= frozen
        # The young generation is collected less often; the older ones as before.
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *default[1:])


def test_only_serve_freezes(unfrozen: None, engine_factory: Callable[..., Any]) -> None:
    """An app built without ``freeze_heap`` (tests, embedding) leaves the collector alone."""
    engine = engine_factory(name="a")
    cfg = gateway_cfg([{"name": "a", "url": engine.url, "kind": "contiguous"}])
    before = gc.get_threshold()
    with run_gateway(cfg):
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before
