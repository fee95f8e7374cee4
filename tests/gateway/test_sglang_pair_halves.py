"""One half of an SGLang pair (``proxy.gateway.sglang_pd._Half``): its reservation is freed
whichever way it ends, including a cancel that comes before it ever ran (its send, which
frees it otherwise, never starts then). A tiny recorder stands for the gateway's ports."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from starlette.responses import Response

from proxy.gateway.context import RequestContext
from proxy.gateway.sglang_pd import PairPorts, _Half


class _Tasks:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release_later(self, ctx: object, backend: str) -> None:
        self.released.append(backend)


class _Gateway:
    def __init__(self) -> None:
        self.tasks = _Tasks()


def _half(gw: _Gateway, coro: Any) -> _Half:
    ctx = cast(RequestContext, object())
    return _Half(cast(PairPorts, gw), ctx, "p1", coro)


async def test_a_half_cancelled_before_it_ran_is_released_here() -> None:
    gw = _Gateway()
    ran: list[bool] = []

    async def send() -> Response | None:
        ran.append(True)
        return None

    half = _half(gw, send())
    # Cancelled in the same step it was created in: the send never starts.
    await half.stop()
    assert ran == [] and half.task.cancelled()
    assert gw.tasks.released == ["p1"]


async def test_a_half_that_ran_frees_its_own_reservation() -> None:
    gw = _Gateway()
    started = asyncio.Event()

    async def send() -> Response | None:
        started.set()
        await asyncio.Event().wait()
        return None

    half = _half(gw, send())
    await started.wait()
    await half.stop()
    # The send's own cleanup (``send_attempt``) frees it: not released a second time here.
    assert half.task.cancelled() and gw.tasks.released == []


async def test_stopping_a_finished_half_changes_nothing() -> None:
    gw = _Gateway()

    async def send() -> Response | None:
        return Response(status_code=200)

    half = _half(gw, send())
    answer = await half.task
    await half.stop()
    assert answer is not None and answer.status_code == 200 and gw.tasks.released == []
