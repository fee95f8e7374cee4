"""The gateway's steps one by one (proxy/gateway/*), on a real in-process store and fleet cache.

No HTTP servers here: intake gets real Starlette requests built from ASGI scopes, placement
and divert run against ``InProcessStore``; the end-to-end walk is tests/e2e/test_gateway_e2e.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from proxy.config import Config
from proxy.core.fleet import MemoryReport
from proxy.core.validation import parse_request
from proxy.errors import UPSTREAM_ANSWERS, ApiError, upstream_answer
from proxy.gateway import divert as divert_step
from proxy.gateway import intake, placement
from proxy.gateway.answers import cause_at_backend
from proxy.gateway.context import FAILURE_RESULTS, RequestContext
from proxy.gateway.metrics import GatewayMetrics
from proxy.gateway.walk import Gateway
from proxy.routing import make_policy
from proxy.routing.policy import PolicySettings
from proxy.state.fleet_cache import FleetCache
from proxy.state.memory import InProcessStore
from proxy.upstream.classify import UpstreamVerdict
from proxy.upstream.client import Upstream
from tests.support.gateway import gateway_cfg

CAP = 100_000
BODY = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
)


def request(body: bytes = BODY, headers: dict[str, str] | None = None) -> Request:
    """A real Starlette request whose body arrives in two pieces."""
    hdrs = {"content-type": "application/json", **(headers or {})}
    pieces = [body[: len(body) // 2], body[len(body) // 2 :]]

    async def receive() -> dict[str, object]:
        chunk = pieces.pop(0) if pieces else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(pieces)}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(k.encode(), v.encode()) for k, v in hdrs.items()],
    }
    return Request(scope, receive)


def config(**sections: object) -> Config:
    backends = [
        {"name": "a", "url": "http://127.0.0.1:9", "pool": "general", "kind": "contiguous"},
        {"name": "b", "url": "http://127.0.0.1:9", "pool": "general", "kind": "contiguous"},
    ]
    return gateway_cfg(backends, **sections)


def make_gateway(**sections: object) -> Gateway:
    cfg = config(retry={"hash_body": True}, **sections)
    store = InProcessStore()
    fleet = FleetCache(cfg, store, refresh_s=0.0)
    policy = make_policy("kvroute", PolicySettings())
    return Gateway(cfg, store, fleet, policy, Upstream(cfg.upstream), GatewayMetrics())


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    gateway = make_gateway()
    yield gateway
    await gateway.close()


async def report(gw: Gateway, name: str, free: int, largest: int) -> None:
    now = time.time()
    await gw.store.put_report(
        name, MemoryReport(CAP, free, largest, reported_at=now, started_at=now - 60), 60.0
    )


async def context(gw: Gateway, req: Request | None = None) -> RequestContext:
    req = req or request()
    parsed = await intake.read_and_parse(gw.cfg, req, "chat")
    started = time.perf_counter()
    return await intake.open_request(
        gw, req, parsed, "res-1", "client-1", started, gw.cfg, gw.policy
    )


def metric(gw: Gateway, name: str, labels: dict[str, str]) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------ intake
async def test_intake_reads_the_body_in_pieces_and_validates_it() -> None:
    parsed = await intake.read_and_parse(config(), request(), "chat")
    assert parsed.raw == BODY and parsed.max_new_tokens == 8


@pytest.mark.parametrize("declared", [True, False])
async def test_intake_refuses_a_body_over_the_limit(declared: bool) -> None:
    cfg = config(limits={"max_body_bytes": 10})
    headers = {"content-length": str(len(BODY))} if declared else {}
    with pytest.raises(ApiError) as err:
        await intake.read_and_parse(cfg, request(headers=headers), "chat")
    assert err.value.status == 413 and err.value.code == "request_too_large"


def test_retry_key_prefers_the_clients_own_ids_namespaced_by_client_and_model() -> None:
    cfg = config(retry={"hash_body": True})
    parsed = parse_request(BODY, "chat", 10 * CAP, "application/json")
    key = intake.retry_key(cfg, request(headers={"idempotency-key": "k"}), parsed)
    assert key is not None and key.endswith(f"|{parsed.model}|k")
    by_id = intake.retry_key(cfg, request(headers={"x-request-id": "r"}), parsed)
    assert by_id is not None and by_id.endswith("|r")
    hashed = intake.retry_key(cfg, request(), parsed)
    assert hashed is not None and "|body:" in hashed
    # Another client's identical key lands in another namespace.
    assert key.split("|")[0] == intake.client_namespace(cfg, request())
    assert intake.retry_key(config(), request(), parsed) is None


async def test_open_request_sizes_classifies_and_recalls_failed_backends(gw: Gateway) -> None:
    await report(gw, "a", CAP, CAP)
    first = await context(gw)
    assert first.demand == first.prompt_tokens + 8 and first.cls == "short"
    assert first.exclude == set()
    assert first.retry_key is not None
    await gw.store.add_failed(first.retry_key, "a", 60.0)
    again = await context(gw)
    assert again.exclude == {"a"}


async def test_open_request_refuses_what_no_backend_could_ever_hold(gw: Gateway) -> None:
    await report(gw, "a", CAP, CAP)
    big = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CAP}
    )
    req = request(big)
    parsed = parse_request(big, "chat", 10 * CAP, "application/json")
    with pytest.raises(ApiError) as err:
        started = time.perf_counter()
        await intake.open_request(gw, req, parsed, "res", "client", started, gw.cfg, gw.policy)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"


# ------------------------------------------------------------------ context
async def test_answer_headers_put_ours_over_the_upstreams(gw: Gateway) -> None:
    ctx = await context(gw)
    ctx.attempts = 2
    upstream = {"Retry-After": "3", "x-kvroute-backend": "spoofed", "x-other": "1"}
    merged = ctx.answer_headers("a", upstream)
    assert merged["x-kvroute-backend"] == "a" and merged["x-kvroute-attempts"] == "2"
    assert merged["x-request-id"] == "client-1" and merged["x-other"] == "1"
    only = ctx.answer_headers("a", upstream, only=frozenset({"retry-after"}))
    assert only["Retry-After"] == "3" and "x-other" not in only


# ------------------------------------------------------------------ placement
async def test_place_reserves_on_the_node_that_fits(gw: Gateway) -> None:
    await report(gw, "a", 5, 5)
    await report(gw, "b", CAP, CAP)
    ctx = await context(gw)
    ctx.snap = await gw.fleet.snapshot(force=True)
    assert await placement.place(gw, ctx) == "b"
    assert ctx.attempts == 1 and set(gw.ledger.held) == {("res-1", "b")}
    state = await gw.store.read(["b"], time.time())
    assert state["b"].overlay(time.time(), 0.0).inflight == 1


async def test_place_answers_why_nothing_fits() -> None:
    # No time in the waiting room: the answer comes at once.
    gw = make_gateway(queue={"max_wait_s": 0.0})
    await report(gw, "a", 50_000, 5)
    await report(gw, "b", 50_000, 5)
    ctx = await context(gw)
    ctx.snap = await gw.fleet.snapshot(force=True)
    answer = await placement.place(gw, ctx)
    assert isinstance(answer, Response) and answer.status_code == 503
    body = orjson.loads(answer.body)
    assert body["error"]["code"] == "no_backend_fits_fragmentation"
    assert answer.headers["retry-after"] == str(gw.cfg.queue.retry_after_s)
    assert (
        metric(
            gw, "kvroute_requests_total", {"class": "short", "backend": "none", "outcome": "no_fit"}
        )
        == 1
    )


async def test_a_retry_beyond_the_budget_returns_the_last_failure(gw: Gateway) -> None:
    await report(gw, "a", CAP, CAP)
    ctx = await context(gw)
    ctx.snap = await gw.fleet.snapshot(force=True)
    failure = upstream_answer("connect_error", "backend a could not be reached")
    ctx.failure = failure
    # Other requests' retries hold every slot of the budget, and none frees in time.
    while gw.budget.try_acquire(gw.active):
        pass
    ctx.deadline = asyncio.get_running_loop().time() + 0.2
    assert await placement.place(gw, ctx) is failure
    assert metric(gw, "kvroute_retries_total", {"reason": "budget_exhausted"}) == 1


async def test_a_retry_waits_for_the_budget_slot_a_release_frees(gw: Gateway) -> None:
    """A backend that dies fails all it held at once: the retries over the cap wait, not fail."""
    await report(gw, "a", CAP, CAP)
    ctx = await context(gw)
    ctx.snap = await gw.fleet.snapshot(force=True)
    ctx.failure = upstream_answer("connect_error", "backend a could not be reached")
    while gw.budget.try_acquire(gw.active):
        pass
    placing = asyncio.create_task(placement.place(gw, ctx))
    await asyncio.sleep(0.15)
    assert not placing.done()  # waiting for a slot, within the cap
    gw.budget.release()
    assert await placing in ("a", "b")
    assert ctx.retries == 1
    assert metric(gw, "kvroute_retries_total", {"reason": "budget_exhausted"}) == 0


# ------------------------------------------------------------------ divert
async def test_divert_books_a_broken_attempt_once(gw: Gateway) -> None:
    await report(gw, "a", CAP, CAP)
    ctx = await context(gw)
    ctx.snap = await gw.fleet.snapshot(force=True)
    assert await placement.place(gw, ctx) in ("a", "b")
    ((_, backend),) = gw.ledger.held
    answer = upstream_answer("ttfb_timeout", f"backend {backend} did not answer")
    divert_step.divert(gw, ctx, backend, answer, result="timeout", broken="no answer")
    await gw.tasks.drain()
    assert gw.ledger.held == {}
    state = await gw.store.read([backend], time.time())
    assert state[backend].overlay(time.time(), 0.0).inflight == 0
    assert ctx.failure is answer and answer.headers["x-kvroute-backend"] == backend
    assert ctx.failed_on == [backend]
    # A timeout is the backend's health problem, not a fit verdict: the client's retry key
    # does not remember it (only allocation failures go on that list).
    assert ctx.retry_key is not None and await gw.store.failed_on(ctx.retry_key) == set()
    assert metric(gw, "kvroute_attempts_total", {"backend": backend, "result": "timeout"}) == 1
    assert gw.health.snapshot()[backend]["consecutive_failures"] == 1


async def test_divert_on_a_full_backend_learns_its_ceiling(gw: Gateway) -> None:
    await report(gw, "a", CAP, CAP)
    ctx = await context(gw)
    divert_step.divert(gw, ctx, "a", None, result="allocation", full=True, retry_after_s=1.0)
    await gw.tasks.drain()
    assert ctx.failure is None and ctx.failed_on == ["a"]
    overlay = (await gw.store.read(["a"], time.time()))["a"].overlay(time.time(), 0.0)
    assert overlay.ceiling_tokens == ctx.demand
    assert overlay.cooldown_until > time.time()
    cooldown = gw.health.snapshot()["a"]["cooldown_for_s"]
    assert isinstance(cooldown, float) and cooldown > 0


async def test_divert_reads_the_config_the_request_started_with(gw: Gateway) -> None:
    """A reload while the request runs does not change how its divert honours Retry-After."""
    await report(gw, "a", CAP, CAP)
    ctx = await context(gw)
    assert ctx.cfg.retry.max_retry_after_s == 30.0
    gw.cfg = config(retry={"hash_body": True, "max_retry_after_s": 1.0})
    divert_step.divert(gw, ctx, "a", None, result="allocation", full=True, retry_after_s=20.0)
    await gw.tasks.drain()
    cooldown = gw.health.snapshot()["a"]["cooldown_for_s"]
    # 20 s as asked (under the request's 30 s cap), not the reloaded 1 s cap.
    assert isinstance(cooldown, float) and cooldown > 10


def test_every_upstream_failure_has_an_answer_and_a_result() -> None:
    assert set(UPSTREAM_ANSWERS) == set(FAILURE_RESULTS)
    for failure, (status, code) in UPSTREAM_ANSWERS.items():
        answer = upstream_answer(failure, "m")
        body = orjson.loads(answer.body)
        assert answer.status_code == status and status in (502, 504)
        assert body["error"] == {
            "message": "m",
            "type": "upstream_error",
            "param": None,
            "code": code,
        }


async def test_cause_at_backend_prefers_the_backends_own_figure(gw: Gateway) -> None:
    await report(gw, "a", 30_000, 1_000)
    snap = await gw.fleet.snapshot(force=True)
    assert cause_at_backend(UpstreamVerdict("allocation"), 20_000, "a", snap) == "fragmentation"
    assert cause_at_backend(UpstreamVerdict("allocation"), 40_000, "a", snap) == "capacity"
    told = UpstreamVerdict("allocation", free_tokens=50_000)
    assert cause_at_backend(told, 40_000, "a", snap) == "fragmentation"


# ------------------------------------------------------------------ memory pressure
async def test_output_keys_are_worked_out_once_per_request_and_per_client(gw: Gateway) -> None:
    first = await context(gw, request(headers={"authorization": "Bearer one"}))
    keys = gw.pressure.keys(first)
    model = f"model:m|{first.cls}"
    assert keys[1] == model and keys[0].startswith("client:") and keys[0].endswith(model)
    assert "one" not in keys[0]  # a hash of the credential, never the credential
    # Asked again (ranking, placement, the answer): the very list, not a new hash.
    assert gw.pressure.keys(first) is keys
    # Another client's request learns under its own key; no credential: the model's only.
    other = await context(gw, request(headers={"authorization": "Bearer two"}))
    assert gw.pressure.keys(other)[0] != keys[0]
    assert gw.pressure.keys(await context(gw)) == [model]
