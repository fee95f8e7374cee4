"""SGLang's disaggregation protocol: the prefill and the decode server get the request at once.

The decode server is placed by the walk as for vLLM's protocol (by fit, reserved first, the
admission hold); then this module places the prefill server (by expected prefill wait, the
prompt reserved there) and sends the *same* request to both, with a fresh bootstrap room
(``proxy.core.bootstrap``). The decode server joins the room on the prefill server's
bootstrap endpoint, the prefill server computes and sends the KV, and the decode server
generates: its answer (a stream or one JSON body) is the client's; the prefill server's is
read and dropped.

Neither half may outlive the other's failure, or it would wait for a room that never fills
(SGLang fails it only after ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``/``BOOTSTRAP_TIMEOUT``,
300 s each) while holding its KV:

* the prefill fails first (down, broken, refused): the decode half is cancelled, its
  reservation released; the pair is placed again, that prefill server left out and the decode
  server still eligible (it did nothing wrong);
* the decode half fails before answering (refused for memory, broken, the transfer lost):
  the prefill half is cancelled (SGLang aborts the room when its request goes); the walk
  diverts as for any attempt, and the next pair gets a new room;
* the decode answers with an error, or the client leaves: the prefill half is cancelled;
* the decode answers: the prefill half (done, or about to be, since the KV came) is read
  to its end in the background and dropped.

Each half frees its own reservation whichever way it ends (``send_attempt``, or ``_Half``
for a half cancelled before it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

import orjson
from starlette.responses import Response

from proxy.config.backends import SGLANG_BOOTSTRAP_PORT
from proxy.core.bootstrap import (
    bootstrap_fields,
    decode_body,
    new_room,
    prefill_body,
    transfer_lost,
)
from proxy.core.two_step import TwoStep
from proxy.gateway import attempt, placement
from proxy.gateway.attempt import AttemptPorts
from proxy.gateway.context import RequestContext
from proxy.gateway.placement import PlacementPorts
from proxy.gateway.send import send_attempt
from proxy.gateway.stream import start_stream

log = logging.getLogger("kvroute.gateway")
# What a client that left gets (nobody reads it), as ``attempt`` answers it.
CLIENT_LEFT = 499


class PairPorts(AttemptPorts, PlacementPorts, Protocol):
    """A pair places and attempts each half like any request."""


class _Half:
    """One half of a pair: its task, and the release owed if it is cancelled before it starts.

    ``send_attempt`` frees the reservation whichever way it ends, once it runs; a task
    cancelled before its first step never runs it, so the release is done here then.
    """

    def __init__(
        self,
        gw: PairPorts,
        ctx: RequestContext,
        backend: str,
        coro: Coroutine[Any, Any, Response | None],
    ) -> None:
        self._gw, self._ctx, self._backend, self._coro = gw, ctx, backend, coro
        self.started = False
        self.task: asyncio.Task[Response | None] = asyncio.ensure_future(self._run())

    async def _run(self) -> Response | None:
        self.started = True
        return await self._coro

    async def stop(self) -> None:
        """Cancel it and wait for its cleanup (the upstream connection dropped, released)."""
        if self.task.done():
            return
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task
        if not self.started:
            self._coro.close()
            self._gw.tasks.release_later(self._ctx, self._backend)


async def forward_pair(
    gw: PairPorts,
    ctx: RequestContext,
    two: TwoStep,
    decode: str,
    sub: RequestContext,
) -> Response | None:
    """Both halves at once on ``decode`` and the prefill server ``sub`` places.

    A Response ends the request; None: the pair failed before answering, place it again.
    """
    placed = await placement.place(gw, sub)
    # Counted now: the decode half's answer headers are written before the pair ends.
    two.prefill_attempts += sub.attempts
    if isinstance(placed, Response):
        # No prefill server can take it: an SGLang decode server cannot compute alone.
        gw.tasks.release_later(ctx, decode)
        if placed.status_code != CLIENT_LEFT:
            gw.metrics.two_step.labels("prefill", "failed").inc()
            placed.headers["x-kvroute-failed-step"] = "prefill"
        return placed
    fields = bootstrap_fields(gw.urls[placed], _bootstrap_port(ctx, placed), new_room())
    sub.parsed = _with_body(sub, prefill_body(two.body, fields))
    # Only what is sent changes: a stream's continuation starts from the client's body (and
    # a decode-mode server refuses it at once, with no room, rather than join a stale one).
    ctx.parsed = dataclasses.replace(ctx.parsed, raw=orjson.dumps(decode_body(two.body, fields)))
    two.prefill_backend = placed
    two.params = fields
    # Both halves go now (``Server-Timing``: decode_sent).
    two.decode_sent_s = time.perf_counter() - ctx.started
    prefill = _Half(gw, sub, placed, send_attempt(gw, sub, placed, start_stream))
    prefill.task.add_done_callback(lambda t: _count_prefill(gw, t))
    second = _Half(gw, ctx, decode, attempt.forward(gw, ctx, decode))
    try:
        return await _race(gw, ctx, two, prefill, second)
    except BaseException:
        await prefill.stop()
        await second.stop()
        raise


async def _race(
    gw: PairPorts,
    ctx: RequestContext,
    two: TwoStep,
    prefill: _Half,
    second: _Half,
) -> Response | None:
    """The decode's answer, unless the prefill fails first (then None: a new pair)."""
    both = {prefill.task, second.task}
    done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    if second.task not in done and not _prefilled(prefill.task):
        await second.stop()
        task = prefill.task
        failed = None if task.cancelled() or task.exception() is not None else task.result()
        return _prefill_failed(gw, ctx, two, failed)
    answer = await second.task
    if answer is None or answer.status_code >= 400:
        await prefill.stop()
    elif not prefill.task.done():
        gw.tasks.spawn(_drop(prefill.task))
    return answer


def _count_prefill(gw: PairPorts, task: asyncio.Task[Response | None]) -> None:
    if _prefilled(task):
        gw.metrics.two_step.labels("prefill", "ok").inc()


def _prefilled(prefill: asyncio.Task[Response | None]) -> bool:
    """The prefill half ended with a 2xx (read and dropped)."""
    if prefill.cancelled() or prefill.exception() is not None:
        return False
    answer = prefill.result()
    return answer is not None and answer.status_code < 400


def _prefill_failed(
    gw: PairPorts, ctx: RequestContext, two: TwoStep, answer: Response | None
) -> Response | None:
    """The prefill half failed first: the client's own mistake ends it, anything else retries."""
    gw.metrics.two_step.labels("prefill", "failed").inc()
    if answer is not None and 400 <= answer.status_code < 500 and answer.status_code != 429:
        answer.headers["x-kvroute-failed-step"] = "prefill"
        return answer
    log.warning(
        "request %s: prefill server %s failed; the pair is placed again without it",
        ctx.request_id,
        two.prefill_backend,
    )
    two.prefill_failed = True
    return None


async def _drop(prefill: asyncio.Task[Response | None]) -> None:
    """Read the prefill server's answer to its end (the KV went out) and drop it."""
    with contextlib.suppress(Exception):
        await prefill


def after_divert(gw: PairPorts, ctx: RequestContext, two: TwoStep, decode: str) -> None:
    """The pair failed before answering: the next pair gets a new room.

    A failed prefill leaves its server out and keeps ``decode`` eligible (the walk left it out
    as for any diverted attempt); a decode that failed other than for memory may have lost
    the KV on its way, so that prefill server is left out too, as for vLLM's protocol, and
    when the decode server says so itself (SGLang's ``KVTransferError``), it stays eligible.
    """
    refused = decode in ctx.no_room
    lost = ctx.failure is not None and transfer_lost(bytes(ctx.failure.body))
    if not two.prefill_failed:
        gw.metrics.two_step.labels("decode", "refused" if refused else "failed").inc()
    if not refused:
        two.prefill_exclude.add(two.prefill_backend)
    if two.prefill_failed or lost:
        # The KV never came (the prefill server failed or died, the link broke): the decode
        # server did nothing wrong and may take the next pair.
        ctx.exclude.discard(decode)
    two.prefill_failed = False
    two.params = None
    ctx.parsed = dataclasses.replace(ctx.parsed, raw=two.raw)


def _bootstrap_port(ctx: RequestContext, backend: str) -> int:
    try:
        return ctx.cfg.backend(backend).bootstrap_port
    except KeyError:
        # Removed by discovery since it was placed: SGLang's default.
        return SGLANG_BOOTSTRAP_PORT


def _with_body(ctx: RequestContext, body: dict[str, Any]) -> Any:
    return dataclasses.replace(ctx.parsed, body=body, raw=orjson.dumps(body))
