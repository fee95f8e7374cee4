"""Startup and shutdown as components (proxy.api.lifecycle): order, reverse, failures.

The generic part is pure logic, tested with recording components; the gateway's own list
is tested through a real app's lifespan (every part that started is stopped, once).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from proxy.api.lifecycle import Component, started
from proxy.api.wiring import GATEWAY_COMPONENTS


def _recording(
    name: str, log: list[str], fail_start: bool = False, fail_stop: bool = False
) -> Component[list[str]]:
    async def start(parts: list[str]) -> None:
        log.append(f"start {name}")
        if fail_start:
            raise RuntimeError(f"{name} cannot start")

    async def stop(parts: list[str]) -> None:
        log.append(f"stop {name}")
        if fail_stop:
            raise RuntimeError(f"{name} cannot stop")

    return Component(name, start, stop)


def _run(components: list[Component[list[str]]], log: list[str]) -> None:
    async def main() -> None:
        async with started(components, log):
            log.append("serving")

    asyncio.run(main())


def test_components_start_in_order_and_stop_reversed() -> None:
    log: list[str] = []
    _run([_recording(n, log) for n in ("a", "b", "c")], log)
    assert log == ["start a", "start b", "start c", "serving", "stop c", "stop b", "stop a"]


def test_a_failed_start_stops_only_what_started_and_raises() -> None:
    log: list[str] = []
    parts = [_recording("a", log), _recording("b", log, fail_start=True), _recording("c", log)]
    with pytest.raises(RuntimeError, match="b cannot start"):
        _run(parts, log)
    assert log == ["start a", "start b", "stop a"]


def test_a_failing_stop_is_logged_and_the_rest_still_stop(caplog: pytest.LogCaptureFixture) -> None:
    log: list[str] = []
    parts = [_recording("a", log), _recording("b", log, fail_stop=True), _recording("c", log)]
    with caplog.at_level(logging.ERROR, logger="kvroute.app"):
        _run(parts, log)
    assert log[-3:] == ["stop c", "stop b", "stop a"]
    assert any("stopping b failed" in r.getMessage() for r in caplog.records)


def test_a_component_without_a_stop_is_skipped_on_shutdown() -> None:
    log: list[str] = []

    async def start(parts: list[str]) -> None:
        log.append("start plain")

    _run([_recording("a", log), Component("plain", start)], log)
    assert log == ["start a", "start plain", "serving", "stop a"]


def test_the_gateway_components_have_distinct_names() -> None:
    names = [c.name for c in GATEWAY_COMPONENTS]
    assert len(names) == len(set(names)) and names[0] == "tokenizers" and names[-1] == "ready"
