"""Through the real gateway and simulated engines: a big new prompt routed on its upper bound.

``proxy.gateway.bound_route`` routes a prompt with much new text on a proven upper bound of
its tokens when the exact count could not change the route, and counts it exactly in a
sizing thread meanwhile. Seen from outside: its reservation holds the bound (above the exact
demand the same body gets once its chunks are cached) until the count is in, then the exact
demand; the sizing metric says ``bound``; and the prompt's blocks reach the prefix index of
the backend chosen.
Where the bound could change the route (a backend the exact count fits and the bound does
not) or the option is off, the request waits for its exact count as before.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from loadtest.bench.big_prompts_load import document
from proxy.api.app import create_app
from proxy.gateway import bound_route, encode_once, sizing_pool
from tests.support.gateway import fleet_state, gateway_cfg, serve_app, wait_until

ON = {"route_on_bound": True}  # off by default (docs/big-prompts.md)

_seeds = itertools.count(900_000)


def big_body() -> dict[str, Any]:
    """A document this process has never sized (~9k tokens, ~40 KB)."""
    doc = document(next(_seeds), 40_000)
    return {"model": "m", "messages": [{"role": "user", "content": doc}], "max_tokens": 8}


def sized_where(url: str, where: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'kvroute_sizing_big_requests_total{{where="{where}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _engines(factory: Callable[..., Any], capacity: int) -> list[dict[str, Any]]:
    engines = [factory(name=f"e{i}", capacity_tokens=capacity) for i in range(2)]
    return [{"name": e.name, "url": e.url, "kind": "contiguous"} for e in engines]


def _ready(url: str) -> None:
    wait_until(lambda: all(b["report"] for b in fleet_state(url)["backends"]), what="reports")


def test_a_new_big_prompt_goes_on_its_bound_and_is_then_counted_and_indexed(
    engine_factory: Callable[..., Any],
) -> None:
    cfg = gateway_cfg(_engines(engine_factory, 1_000_000), sizing=ON)
    app = create_app(cfg)
    with serve_app(app, cfg) as url, httpx.Client(base_url=url, timeout=30) as client:
        _ready(url)
        gateway = app.state.rt.gateway
        body = big_body()
        before = sized_where(url, "bound")
        first = client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert sized_where(url, "bound") == before + 1
        backend = first.headers["x-kvroute-backend"]
        # Counted in the background: its blocks reach the chosen backend's index.
        wait_until(lambda: gateway.affinity.index.size(backend) > 0, what="blocks indexed")
        again = client.post("/v1/chat/completions", json=body)
        assert again.status_code == 200
        # The same body, now from the chunk cache: exact, no bound (the bound and its
        # reservation: test_the_reservation_shrinks_to_the_exact_count_when_it_arrives).
        assert sized_where(url, "bound") == before + 1
        assert again.headers["x-kvroute-backend"] == backend  # its prefix is there


@pytest.mark.parametrize("shared", [False, True], ids=["embedded", "redis"])
def test_the_reservation_shrinks_to_the_exact_count_when_it_arrives(
    engine_factory: Callable[..., Any], request: pytest.FixtureRequest, shared: bool
) -> None:
    # Placed on its bound while the sizing thread is busy, the request holds the bound on
    # its backend; once the count is in, the same reservation holds the exact demand.
    store = {"redis_url": request.getfixturevalue("redis_server")} if shared else {}
    engines = [engine_factory(name=f"e{i}", capacity_tokens=1_000_000) for i in range(2)]
    backends = [{"name": e.name, "url": e.url, "kind": "contiguous"} for e in engines]
    cfg = gateway_cfg(backends, sizing=ON, store=store)
    with serve_app(create_app(cfg), cfg) as url, httpx.Client(base_url=url, timeout=60) as client:
        _ready(url)
        wait_until(lambda: bound_route.pending() == 0, what="earlier counts done")
        for e in engines:
            e.fault("hang")  # the request stays in flight, its reservation held
        body = big_body()
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.append(client.post("/v1/chat/completions", json=body))
        )
        release = threading.Event()
        blocker = sizing_pool.executor().submit(release.wait, 60)
        try:
            sender.start()
            wait_until(lambda: sum(reserved(url).values()) > 0, what="the bound reserved")
            backend, bound = next((n, t) for n, t in reserved(url).items() if t > 0)
        finally:
            release.set()
        blocker.result(timeout=5)
        assert bound >= len(body["messages"][0]["content"]) + 8  # at most 1 token per byte
        wait_until(lambda: 0 < reserved(url)[backend] < bound, what="the reservation shrunk")
        exact = reserved(url)[backend]
        # The other engine first: the hung attempt's connection then closes, and it is
        # diverted to an engine that answers.
        for e in sorted(engines, key=lambda e: e.name == backend):
            e.fault("none")
        sender.join(timeout=30)
        assert [a.status_code for a in answers] == [200]
        # The later attempt reserved the exact demand too; it is what the same body's exact
        # count gives, from the chunk cache.
        assert int(answers[0].headers["x-kvroute-demand-tokens"]) == exact
        again = client.post("/v1/chat/completions", json=body)
        assert int(again.headers["x-kvroute-demand-tokens"]) == exact < bound
        wait_until(lambda: sum(reserved(url).values()) == 0, what="every reservation released")


def reserved(url: str) -> dict[str, int]:
    """Tokens reserved per backend, as ``GET /fleet`` shows them."""
    return {b["name"]: int(b["overlay"]["reserved_tokens"]) for b in fleet_state(url)["backends"]}


def test_where_the_bound_could_change_the_route_the_exact_count_is_awaited(
    engine_factory: Callable[..., Any],
) -> None:
    # Each engine holds the exact demand (~9k tokens) but not the bound (~40k bytes).
    cfg = gateway_cfg(_engines(engine_factory, 20_000), sizing=ON)
    with serve_app(create_app(cfg), cfg) as url, httpx.Client(base_url=url, timeout=30) as client:
        _ready(url)
        before = sized_where(url, "bound")
        body = big_body()
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert sized_where(url, "bound") == before
        again = client.post("/v1/chat/completions", json=body)
        assert r.headers["x-kvroute-demand-tokens"] == again.headers["x-kvroute-demand-tokens"]


def test_route_on_bound_off_waits_for_the_exact_count(engine_factory: Callable[..., Any]) -> None:
    cfg = gateway_cfg(_engines(engine_factory, 1_000_000), sizing={"route_on_bound": False})
    with serve_app(create_app(cfg), cfg) as url, httpx.Client(base_url=url, timeout=30) as client:
        _ready(url)
        before = sized_where(url, "bound")
        body = big_body()
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert sized_where(url, "bound") == before
        again = client.post("/v1/chat/completions", json=body)
        assert r.headers["x-kvroute-demand-tokens"] == again.headers["x-kvroute-demand-tokens"]


def test_counts_behind_routed_requests_are_bounded_then_requests_wait_for_their_own(
    engine_factory: Callable[..., Any],
) -> None:
    cfg = gateway_cfg(_engines(engine_factory, 1_000_000), sizing=ON)
    limit = bound_route.PENDING_PER_THREAD * cfg.sizing.threads
    with serve_app(create_app(cfg), cfg) as url, httpx.Client(base_url=url, timeout=60) as client:
        _ready(url)
        wait_until(lambda: bound_route.pending() == 0, what="earlier counts done")
        release = threading.Event()
        # The sizing thread is busy: no exact count can finish until released.
        blocker = sizing_pool.executor().submit(release.wait, 60)
        try:
            before = sized_where(url, "bound")
            for _ in range(limit):
                assert client.post("/v1/chat/completions", json=big_body()).status_code == 200
            assert sized_where(url, "bound") == before + limit
            assert bound_route.pending() == limit
            answered: list[int] = []
            late = threading.Thread(
                target=lambda: answered.append(
                    client.post("/v1/chat/completions", json=big_body()).status_code
                )
            )
            late.start()
            # One more waits for its own count (no bound), behind the busy sizing thread.
            late.join(timeout=1.0)
            assert late.is_alive() and not answered
        finally:
            release.set()
        late.join(timeout=30)
        blocker.result(timeout=5)
        assert answered == [200]
        assert sized_where(url, "bound") == before + limit
        wait_until(lambda: bound_route.pending() == 0, what="counts done")


def test_requests_bringing_the_same_new_document_at_once_encode_it_once(
    engine_factory: Callable[..., Any],
) -> None:
    cfg = gateway_cfg(_engines(engine_factory, 1_000_000), sizing={"route_on_bound": False})
    doc = document(next(_seeds), 40_000)
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": f"Q{i}?\n{doc}"}], "max_tokens": 8}
        for i in range(6)
    ]
    with serve_app(create_app(cfg), cfg) as url, httpx.Client(base_url=url, timeout=60) as client:
        _ready(url)
        missed = miss_bytes(url)
        release = threading.Event()
        blocker = sizing_pool.executor().submit(release.wait, 60)
        codes: list[int] = []
        senders = [
            threading.Thread(
                target=lambda b=b: codes.append(
                    client.post("/v1/chat/completions", json=b).status_code
                )
            )
            for b in bodies
        ]
        try:
            for s in senders:
                s.start()
            # One request's encode is queued behind the busy thread; the others wait for it.
            wait_until(lambda: encode_once.waiting() == len(bodies) - 1, what="waiters")
        finally:
            release.set()
        for s in senders:
            s.join(timeout=30)
        blocker.result(timeout=5)
        assert codes == [200] * len(bodies)
        # The document once, plus each request's own first chunk (its question): not 6 times.
        assert miss_bytes(url) - missed < 2 * len(doc)


def miss_bytes(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith('kvroute_sizing_chunk_cache_bytes_total{result="miss"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
