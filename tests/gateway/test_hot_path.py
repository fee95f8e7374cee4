"""The request path's shortcuts (docs/benchmarks.md, Issue 12) do what the long way did.

Each one replaced a general mechanism measured on the hot path (a task, a
``dataclasses.replace``, a catalog built per request); these tests hold them to the same
results as the general mechanism.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import fields, replace

import pytest
from starlette.datastructures import Headers
from starlette.types import Receive

from proxy.config import Config
from proxy.core.fleet import FleetSnapshot, MemoryReport, NodeView, Overlay
from proxy.gateway.affinity import Affinity, AffinityKey
from proxy.gateway.client_watch import WATCH_AFTER_S, ClientWatch, due_watches
from proxy.gateway.ledger import ReservationLedger
from proxy.gateway.models import CatalogCache
from proxy.routing.policy import RouteRequest
from proxy.state.breaker import CircuitBreaker
from proxy.state.memory import InProcessStore
from proxy.upstream.client import forward_headers, header


def test_plus_pending_keeps_every_other_field() -> None:
    # Every field set away from its default: a field plus_pending forgets shows here.
    ov = Overlay(1, 2, 3, True, 4.0, 5, 6.0, "queue", 7, 1)
    assert {f.name for f in fields(Overlay)} == {
        "pending_tokens",
        "reserved_tokens",
        "inflight",
        "draining",
        "cooldown_until",
        "ceiling_tokens",
        "ceiling_until",
        "pressure",
        "projected_tokens",
        "engine",
    }, "a new Overlay field: add it to Overlay.plus_pending"
    assert ov.plus_pending(10, 2) == replace(ov, pending_tokens=11, reserved_tokens=12, inflight=5)
    node = NodeView("b", "long", "long", False, MemoryReport(9, 8, 7), ov)
    assert {f.name for f in fields(NodeView)} == {
        "name",
        "pool",
        "role",
        "up",
        "report",
        "overlay",
    }, "a new NodeView field: add it to NodeView.with_overlay"
    assert node.with_overlay(Overlay()) == replace(node, overlay=Overlay())


def _cfg(*names: str) -> Config:
    return Config.model_validate(
        {"backends": [{"name": n, "url": f"http://127.0.0.1:1/{n}"} for n in names]}
    )


def test_the_catalog_follows_changed_model_lists_and_configs() -> None:
    lists: dict[str, dict[str, int | None]] = {"a": {"m": 100}}

    def lookup(name: str) -> Mapping[str, int | None] | None:
        return lists.get(name)

    cache, cfg = CatalogCache(), _cfg("a", "b")
    first = cache.get(cfg, lookup)
    assert cache.get(cfg, lookup) is first  # nothing changed: not built again
    assert first.model_limit("m") == 100
    # Changed in place (same dict object): still seen.
    lists["a"]["m"] = 200
    assert cache.get(cfg, lookup).model_limit("m") == 200
    lists["b"] = {"m": 300}
    assert cache.get(cfg, lookup).model_limit("m") == 300
    other = _cfg("a")
    assert [b.name for b in cache.get(other, lookup).backends] == ["a"]
    # Routes follow the catalog they were computed on.
    route = cache.route(other, lookup, "m")
    assert route is not None and route.limit == 200
    lists["a"]["m"] = 50
    route = cache.route(other, lookup, "m")
    assert route is not None and route.limit == 50
    assert cache.route(other, lookup, "nowhere") is None


def _quiet_request() -> tuple[Receive, asyncio.Event]:
    """A request's receive, whose client disconnects when the event is set."""
    left = asyncio.Event()

    async def receive() -> dict[str, object]:
        await left.wait()
        return {"type": "http.disconnect"}

    return receive, left


async def test_the_watch_cancels_the_block_when_the_client_leaves() -> None:
    request, left = _quiet_request()
    reached_after = False
    # A plain ``with``, as the attempt uses it (the relay's ``async with`` below).
    with ClientWatch(request) as watch:
        left.set()
        await asyncio.sleep(5)
        reached_after = True
    assert watch.gone and not reached_after
    # The task is not left cancelled: it can still wait.
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    await asyncio.sleep(0)


async def test_the_watch_lets_other_cancellations_through_and_ignores_a_late_disconnect() -> None:
    request, left = _quiet_request()

    async def body() -> None:
        async with ClientWatch(request):
            await asyncio.sleep(5)

    task = asyncio.ensure_future(body())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # After its block, a disconnect cancels nothing.
    request, left = _quiet_request()
    async with ClientWatch(request) as watch:
        pass
    left.set()
    await asyncio.sleep(0.01)
    assert not watch.gone


async def test_watches_start_at_their_own_time_and_only_while_their_block_runs() -> None:
    """One line of watches per loop: each starts WATCH_AFTER_S after its block began, one
    that ended before that never starts, and a later one still starts after an earlier leaves."""
    started: list[str] = []
    first = asyncio.Event()

    def watched(name: str) -> Receive:
        async def receive() -> dict[str, object]:
            started.append(name)
            first.set()
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        return receive

    loop = asyncio.get_running_loop()
    short = ClientWatch(watched("short"))
    long_ = ClientWatch(watched("long"))
    began = loop.time()
    with short:
        await asyncio.sleep(WATCH_AFTER_S / 2)
        long_.__enter__()
    # ``short`` ended before its time: never watched. ``long`` is watched from its own time.
    await asyncio.sleep(WATCH_AFTER_S * 0.6)
    assert started == []
    await asyncio.wait_for(first.wait(), 5)
    assert started == ["long"] and loop.time() - began >= WATCH_AFTER_S * 1.5 - 0.002
    long_.__exit__(None, None, None)
    assert not long_.gone and due_watches().pending == {}


class _Slow(InProcessStore):
    """An embedded store whose calls wait: it gets the general path."""

    async def release(self, name: str, reservation_id: str) -> None:
        await asyncio.sleep(0)
        await super().release(name, reservation_id)


async def test_the_embedded_store_releases_at_once_and_others_in_one_batch() -> None:
    store = InProcessStore()
    ledger = ReservationLedger(store, CircuitBreaker(3, 1.0), 60.0)
    assert await ledger.reserve(
        "a", "r1", lambda: store.reserve("a", "r1", 5, 1.0, 60.0, check_fit=False)
    )
    assert [r.id for r in await store.reservations("a", 1.0)] == ["r1"]
    assert ledger.release_at_once("a", "r1")
    assert await store.reservations("a", 1.0) == [] and ledger.held == {}
    # Any other store: queued, and the releases of one loop turn go out in one batch.
    slow = _Slow()
    calls: list[list[tuple[str, str]]] = []
    original = slow.release_many

    async def release_many(items: list[tuple[str, str]]) -> None:
        calls.append(list(items))
        await original(items)

    slow.release_many = release_many  # type: ignore[method-assign]
    slow_ledger = ReservationLedger(slow, CircuitBreaker(3, 1.0), 60.0)
    for rid, backend in (("r1", "a"), ("r2", "a"), ("r3", "b")):
        assert await slow.reserve(backend, rid, 5, 1.0, 60.0, check_fit=False)
        slow_ledger.hold(backend, rid)
    assert all(
        slow_ledger.release_at_once(b, rid) for rid, b in (("r1", "a"), ("r2", "a"), ("r3", "b"))
    )
    assert len(await slow.reservations("a", 1.0)) == 2  # not before this task yields
    await slow_ledger.close()
    assert calls == [[("a", "r1"), ("a", "r2"), ("b", "r3")]]
    assert await slow.reservations("a", 1.0) == [] and await slow.reservations("b", 1.0) == []


async def test_the_embedded_reserve_at_once_answers_as_the_awaited_one() -> None:
    store, twin = InProcessStore(), InProcessStore()
    report = MemoryReport(1000, 1000, 100, reported_at=1.0)
    await store.put_report("a", report, 60.0)
    await twin.put_report("a", report, 60.0)
    ledger = ReservationLedger(store, CircuitBreaker(3, 1.0), 60.0)
    twin_ledger = ReservationLedger(twin, CircuitBreaker(3, 1.0), 60.0)
    # 60 fits the 100-token block, a second 60 does not: the same answers, the same holdings.
    for rid in ("r1", "r2"):
        at_once = ledger.reserve_at_once(
            "a", rid, lambda rid=rid: store.reserve("a", rid, 60, 2.0, 60.0), 60, 2.0
        )
        awaited = await twin_ledger.reserve(
            "a", rid, lambda rid=rid: twin.reserve("a", rid, 60, 2.0, 60.0), 60, 2.0
        )
        assert at_once == awaited
    assert (ledger.held, ledger.claims) == (twin_ledger.held, twin_ledger.claims) != ({}, {})
    assert await store.reservations("a", 2.0) == await twin.reservations("a", 2.0)
    # Bad arguments raise as they do awaited, and leave nothing held.
    with pytest.raises(ValueError):
        ledger.reserve_at_once("a", "r3", lambda: store.reserve("a", "r3", -1, 2.0, 60.0))
    assert ("r3", "a") not in ledger.held


async def test_the_reserve_at_once_leaves_other_cases_to_the_awaited_path() -> None:
    store = InProcessStore()
    breaker = CircuitBreaker(1, 60.0)
    ledger = ReservationLedger(store, breaker, 60.0)
    called: list[str] = []

    async def reserve() -> bool:
        called.append("r")
        return True

    ledger.mark_unsure()  # a re-assert is due: it must run first, awaited
    assert ledger.reserve_at_once("a", "r1", reserve) is None
    ledger.store_may_have_lost = False
    breaker.failure()  # open: the awaited path answers StoreUnavailable and counts it
    assert ledger.reserve_at_once("a", "r1", reserve) is None
    # Any store but exactly the embedded one may wait inside its calls.
    assert (
        ReservationLedger(_Slow(), CircuitBreaker(3, 1.0), 60.0).reserve_at_once("a", "r1", reserve)
        is None
    )
    assert called == []


def test_route_request_keeps_every_field_it_does_not_set() -> None:
    assert {f.name for f in fields(RouteRequest)} == {
        "demand",
        "cls",
        "exclude",
        "cached",
        "session_node",
        "indexed",
        "ttft",
        "ttft_slack_s",
        "blind",
    }, "a new RouteRequest field: add it to Affinity.route_request"
    affinity = Affinity(_cfg("a", "b"))
    base = RouteRequest(700, "long", frozenset({"b"}))
    view = FleetSnapshot((NodeView("a", report=MemoryReport(1000, 900, 900)),))
    made = affinity.route_request(AffinityKey((), "s"), base, view, 1.0)
    assert made == replace(
        base, cached={}, session_node=None, indexed=None, ttft=None, ttft_slack_s=0.0
    )


def test_header_reads_as_starlette_get() -> None:
    raw = [(b"x-request-id", b"r1"), (b"x-request-id", b"r2"), (b"connection", b"close")]
    headers = Headers(raw=raw)
    for name in ("x-request-id", "connection", "idempotency-key"):
        assert header(headers, name) == headers.get(name)


def test_forward_headers_read_connection_once_and_keep_the_last_duplicate() -> None:
    raw = [
        (b"x-a", b"1"),
        (b"connection", b"x-b"),
        (b"x-b", b"2"),
        (b"x-a", b"3"),
        (b"connection", b"x-a"),
    ]
    # Starlette's get: the first Connection header names what to drop; the last x-a stands.
    assert forward_headers(Headers(raw=raw), False) == {"x-a": "3"}
    assert forward_headers(Headers(raw=raw[:1]), False) == {"x-a": "1"}
