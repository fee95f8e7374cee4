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


def test_a_gateway_whose_start_fails_half_way_stops_what_had_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real app's lifespan, one injected fault (discovery cannot start): the upstream
    pool, the collector and the gateway that had started are all stopped again."""
    import proxy.api.app as app_module
    from proxy.api.app import create_app
    from proxy.api.wiring import Wiring
    from tests.support.gateway import gateway_cfg

    seen: list[Wiring] = []

    async def spy(w: Wiring) -> None:
        seen.append(w)

    async def broken(w: Wiring) -> None:
        raise RuntimeError("discovery cannot start")

    components = [Component("spy", spy)] + [
        Component(c.name, broken, c.stop) if c.name == "discovery" else c
        for c in GATEWAY_COMPONENTS
    ]
    monkeypatch.setattr(app_module, "GATEWAY_COMPONENTS", components)
    app = create_app(gateway_cfg([{"name": "a", "url": "http://127.0.0.1:1"}]))

    async def main() -> None:
        async with app.router.lifespan_context(app):
            raise AssertionError("the app must not start")

    with pytest.raises(RuntimeError, match="discovery cannot start"):
        asyncio.run(main())
    (w,) = seen
    assert w.upstream.session is None and w.upstream.pool is None
    assert w.collector is not None and not w.collector.running
    assert w.gateway.checker is None and not w.ops._rounds.running
