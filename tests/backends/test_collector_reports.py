"""Collector reports under faults: when figures were taken, odd values, fall/rise.

Real HTTP scrapes (aiohttp on 127.0.0.1) into the embedded store; the clock is injected.
Before: reports were stamped when the body arrived (a reservation made during a slow
scrape counted as visible, and a report whose figures predate a learned ceiling lifted
it); ``block_size="inf"`` raised OverflowError out of the whole round (no backend was
published); and one failed scrape marked a backend down at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from proxy.backends.collector import Collector
from proxy.state import InProcessStore
from tests.backends.test_collector import KVROUTE_CONTIGUOUS, NOW, Clock, make_config

Hook = Callable[[], Awaitable[None]]


class Pages:
    """/metrics bodies per path, and a hook run when a scrape arrives (before answering)."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[int, str]] = {}
        self.on_request: Hook | None = None
        self.port = 0

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.Response:
        if self.on_request is not None:
            await self.on_request()
        status, text = self.pages.get(request.path, (404, "not found"))
        return web.Response(status=status, text=text, content_type="text/plain")


@pytest.fixture
async def pages() -> AsyncIterator[Pages]:
    srv = Pages()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", srv.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    srv.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield srv
    finally:
        await runner.cleanup()


async def test_report_is_stamped_when_the_scrape_started(pages: Pages) -> None:
    pages.pages["/metrics"] = (200, KVROUTE_CONTIGUOUS)
    clock = Clock()

    async def slow_backend() -> None:
        clock.t += 10.0  # the figures are ready ten seconds after the scrape began

    pages.on_request = slow_backend
    cfg = make_config([{"name": "a", "url": pages.url(), "kind": "contiguous"}])
    store = InProcessStore()
    collector = Collector(cfg, store, "gw", clock=clock)
    try:
        await collector.scrape_once()
    finally:
        await collector.stop()
    report = (await store.read(["a"], clock.t))["a"].report
    assert report is not None and report.reported_at == NOW


async def test_a_report_older_than_a_ceiling_does_not_lift_it(pages: Pages) -> None:
    """The ceiling is learned while the scrape is on its way: that scrape's figures predate it."""
    pages.pages["/metrics"] = (200, KVROUTE_CONTIGUOUS)  # largest free block 1,200
    clock = Clock()
    store = InProcessStore()

    async def ceiling_learned_meanwhile() -> None:
        clock.t += 1.0
        await store.set_ceiling("a", 1_000, clock.t, clock.t + 60)
        clock.t += 1.0  # and the body arrives later still

    pages.on_request = ceiling_learned_meanwhile
    cfg = make_config([{"name": "a", "url": pages.url(), "kind": "contiguous"}])
    collector = Collector(cfg, store, "gw", clock=clock)
    try:
        await collector.scrape_once()
        overlay = (await store.read(["a"], clock.t))["a"].overlay(clock.t, 0.0)
        assert overlay.ceiling_tokens == 1_000
        # The next scrape's figures are taken after the ceiling: it lifts it.
        pages.on_request = None
        clock.t += 1.0
        await collector.scrape_once()
        overlay = (await store.read(["a"], clock.t))["a"].overlay(clock.t, 0.0)
        assert overlay.ceiling_tokens is None
    finally:
        await collector.stop()


async def test_one_odd_metric_value_fails_that_backend_only(pages: Pages) -> None:
    odd = KVROUTE_CONTIGUOUS.replace('block_size="1"', 'block_size="inf"')
    pages.pages = {"/metrics": (200, KVROUTE_CONTIGUOUS), "/odd": (200, odd)}
    cfg = make_config(
        [
            {"name": "odd", "url": pages.url(), "kind": "contiguous", "metrics_path": "/odd"},
            {"name": "fine", "url": pages.url(), "kind": "contiguous"},
        ]
    )
    store = InProcessStore()
    collector = Collector(cfg, store, "gw", clock=Clock())
    try:
        outcomes = await asyncio.wait_for(collector.scrape_once(), 10)
    finally:
        await collector.stop()
    assert outcomes is not None and outcomes["fine"].ok and not outcomes["odd"].ok
    states = await store.read(["odd", "fine"], NOW)
    assert states["fine"].status == "up" and states["fine"].report is not None
    assert states["odd"].status == "down" and "unreadable" in states["odd"].status_reason


async def test_fall_and_rise_counts(pages: Pages) -> None:
    pages.pages["/metrics"] = (200, KVROUTE_CONTIGUOUS)
    cfg = make_config([{"name": "a", "url": pages.url(), "kind": "contiguous"}], fall=2, rise=2)
    store = InProcessStore()
    collector = Collector(cfg, store, "gw", clock=Clock())

    async def status_after_scrape() -> str:
        await collector.scrape_once()
        return (await store.read(["a"], NOW))["a"].status

    try:
        assert await status_after_scrape() == "up"
        pages.pages["/metrics"] = (500, "oops")
        assert await status_after_scrape() == "up"  # one failed scrape: still up
        assert await status_after_scrape() == "down"  # the second in a row: down
        pages.pages["/metrics"] = (200, KVROUTE_CONTIGUOUS)
        assert await status_after_scrape() == "down"  # one good scrape of two
        assert await status_after_scrape() == "up"
    finally:
        await collector.stop()
