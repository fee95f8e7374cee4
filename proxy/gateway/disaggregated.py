"""Two-step requests (disaggregated prefill and decode): step 1 inside the one request walk.

The walk places the decode step first, as any request: by fit, since the decode server holds
the prompt and the whole output for the whole generation (lazy growth and every reservation
in flight counted, prefix affinity and fragmentation as for any request). With that
reservation held, step 1 runs here (or before the decode placement, when no decode server
fits yet and the decode step will hold: the prompt is computed while it waits): a prefill server chosen by expected prefill wait
(``proxy.routing.prefill_wait``) computes the prompt and returns ``kv_transfer_params``
(``proxy.core.two_step``); the walk then forwards step 2 to the decode server it reserved,
with those params in the body. Step 1 is itself a one-step request on a sub-context: the
same placement, reservation, retry budget, diversion, client watch and error answers.

What each failure does:

* step 1 fails on every prefill server (down, broken, overloaded): the decode server runs
  the request itself (a decode server without ``kv_transfer_params`` computes the prompt);
  the client gets an answer, slower, never an outage that another backend could serve;
* the client's own mistake (a 4xx from the prefill server) is its answer, as in one step;
* the client leaves during step 1: the decode reservation is released, the answer is 499;
* step 2 refused for memory before the pull: the prefill server still holds the KV, the
  next decode server gets the same params;
* step 2 fails otherwise (the prefill server died, the pull broke): step 1 runs again.

Blocks a prefill server holds for a decode that never comes (the client left between the
steps, the decode failed before its pull) are freed by the prefill server itself: vLLM's
NIXL connector frees them after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` seconds (480 by
default) without a read; no API lets a proxy free them sooner.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Protocol

import orjson
from starlette.responses import Response

from proxy.core.two_step import (
    Step,
    TwoStep,
    decode_body,
    failure_cause,
    not_prefill,
    prefill_body,
    prefill_only,
    transfer_params,
    worth_two_steps,
)
from proxy.gateway import attempt, placement, sglang_pd
from proxy.gateway.attempt import AttemptPorts
from proxy.gateway.context import RequestContext
from proxy.gateway.held_room import nodes_kept
from proxy.gateway.hold_prefill import claim_share, prefill_pending
from proxy.gateway.models import CatalogCache, ModelsLookup
from proxy.gateway.placement import PlacementPorts
from proxy.routing.decode_fit import DecodeFitPolicy
from proxy.routing.policy import RouteRequest
from proxy.routing.prefill_wait import PrefillWaitPolicy

log = logging.getLogger("kvroute.gateway")


class TwoStepPorts(AttemptPorts, PlacementPorts, Protocol):
    """A two-step request places and attempts each step like any request."""

    # The model catalog: step 1 needs a context for the prompt only.
    catalogs: CatalogCache
    models_info: ModelsLookup


# The answer a client that left gets (nobody reads it), as ``attempt`` answers it.
CLIENT_LEFT = 499


def begin(gw: TwoStepPorts, ctx: RequestContext) -> None:
    """Prefill-only servers never take an ordinary request; a disaggregated fleet takes two steps."""
    backends = ctx.cfg.backends
    only = prefill_only(backends)
    if not only:
        return
    ruled_out = ctx.ruled_out
    ctx.ruled_out = ruled_out | only
    body = ctx.parsed.body
    if "kv_transfer_params" in body or "bootstrap_room" in body:
        # The client drives the transfer itself (a proxy in front of us): one step.
        return
    if ctx.cfg.disaggregation.order() == "best_fit":
        ctx.policy = DecodeFitPolicy(ctx.policy)
    ctx.two_step = TwoStep(
        body=body,
        raw=ctx.parsed.raw,
        ruled_out=ruled_out - _long_enough_for_step_1(gw, ctx),
        prefill_only=only,
        decode_only=not_prefill(backends),
        # Read before the decode placement records the prompt as cached where it goes.
        cached=_cached(gw, ctx),
    )


def _long_enough_for_step_1(gw: TwoStepPorts, ctx: RequestContext) -> frozenset[str]:
    """Backends too short for the whole request (prompt + max_tokens) but not for step 1.

    Step 1 asks for one token: a prefill server with a shorter context (less KV, as prefill
    servers often have) computes the prompt all the same.
    """
    catalog = gw.catalogs.get(ctx.cfg, gw.models_info)
    model = ctx.parsed.model
    asked = ctx.parsed.max_tokens if ctx.parsed.max_tokens is not None else 1
    whole = catalog.too_small(model, ctx.prompt_tokens + asked)
    return whole - catalog.too_small(model, ctx.prompt_tokens + 1)


async def prefill_while_holding(
    gw: TwoStepPorts, ctx: RequestContext, during_hold: bool = False
) -> Response | None:
    """Step 1 before the decode placement when no decode server fits now.

    The decode step will hold at the gateway until one fits; step 1 does not need it, so the
    prompt is computed meanwhile (the prefill server holds the blocks a little longer, well
    within its pull timeout). ``during_hold``: asked again by the hold, now that a prefill
    server has its share free (``proxy.gateway.hold_prefill``). A Response ends the request
    (nothing reserved yet).
    """
    two = ctx.two_step
    if two is None or not prefill_pending(ctx):
        return None
    avoid = gw.health.avoid() | ctx.ruled_out | ctx.exclude
    now = gw.clock()
    # The view placement ranks on: projected peaks where the memory-pressure projection is on.
    view = gw.pressure.apply(gw.local.apply(ctx.snap), ctx, now)
    kept = nodes_kept(gw.pressure, ctx, view, avoid)
    request = RouteRequest(ctx.demand, ctx.cls, avoid | (kept or frozenset()))
    if kept is not None and ctx.policy.rank(view, request, now):
        # A decode server fits now: reserve it first, then prefill for it.
        return None
    full = claim_share(gw.early_prefills, ctx, two)
    if full is None:
        # Every prefill server holds its share for waiting requests: step 1 when one frees
        # (``hold_prefill``), or after the decode placement.
        if not during_hold:
            gw.metrics.two_step.labels("prefill", "after_holding").inc()
        return None
    gw.metrics.two_step.labels("prefill", "during_hold" if during_hold else "while_holding").inc()
    answer = await _prefill(gw, ctx, two, full, early=True)
    if two.params is None:
        # No blocks held for it after all (step 1 failed, or no KV connector there).
        gw.early_prefills.release(ctx.reservation_id)
    return answer


async def prefill_if_wanted(gw: TwoStepPorts, ctx: RequestContext, decode: str) -> Response | None:
    """Step 1 for a request placed on ``decode``; a Response ends the request (reservation freed)."""
    two = ctx.two_step
    if two is None:
        return None
    two.hold_s = time.perf_counter() - ctx.started
    if _sglang(ctx):
        # Both halves go at once (``forward``).
        return None
    # Step 2 goes now: the decode server pulls what a prefill during the hold computed.
    gw.early_prefills.release(ctx.reservation_id)
    answer = await _prefill_for(gw, ctx, two, decode)
    two.decode_sent_s = time.perf_counter() - ctx.started
    return answer


async def _prefill_for(
    gw: TwoStepPorts, ctx: RequestContext, two: TwoStep, decode: str
) -> Response | None:
    if two.step == "decode":
        return None
    threshold = ctx.cfg.disaggregation.min_uncached_prompt_tokens
    if not worth_two_steps(ctx.prompt_tokens, two.cached.get(decode, 0), threshold):
        two.skipped = True
        gw.metrics.two_step.labels("prefill", "skipped").inc()
        return None
    try:
        answer = await _prefill(gw, ctx, two)
    except BaseException:
        gw.tasks.release_later(ctx, decode)
        raise
    if answer is not None:
        gw.tasks.release_later(ctx, decode)
    return answer


async def _prefill(
    gw: TwoStepPorts,
    ctx: RequestContext,
    two: TwoStep,
    full: frozenset[str] = frozenset(),
    early: bool = False,
) -> Response | None:
    """Step 1 on the prefill server with the shortest expected wait (``full``: left out).

    ``early``: during the decode hold, its share (``hold_prefill.claim_share``) moves to the
    server step 1 lands on."""
    sub = _prefill_context(gw, ctx, two)
    sub.exclude |= full
    started = time.perf_counter()
    try:
        while True:
            placed = await placement.place(gw, sub)
            if isinstance(placed, Response):
                _no_prefill(gw, ctx, two, placed)
                return None
            if early:
                gw.early_prefills.move(ctx.reservation_id, placed)
            answer = await attempt.forward(gw, sub, placed)
            if answer is None:
                await placement.move_on(gw, sub, placed)
                continue
            return _prefilled(gw, ctx, two, placed, answer)
    finally:
        gw.budget.release(sub.retries)
        two.prefill_attempts += sub.attempts
        two.prefill_s = time.perf_counter() - started


def _prefill_context(gw: TwoStepPorts, ctx: RequestContext, two: TwoStep) -> RequestContext:
    """Step 1 as a one-step request of its own: one token, no stream, a remote decode asked for."""
    body = prefill_body(two.body)
    parsed = dataclasses.replace(
        ctx.parsed, body=body, raw=orjson.dumps(body), stream=False, max_tokens=1, sequences=1
    )
    rates = gw.queues.current(ctx.snap).rates
    return RequestContext(
        request=ctx.request,
        parsed=parsed,
        reservation_id=ctx.reservation_id,
        request_id=ctx.request_id,
        started=ctx.started,
        deadline=ctx.deadline,
        prompt_tokens=ctx.prompt_tokens,
        demand=ctx.prompt_tokens + 1,
        cls=ctx.cls,
        snap=ctx.snap,
        retry_key=None,
        upstream_headers=ctx.upstream_headers,
        cfg=ctx.cfg,
        policy=PrefillWaitPolicy(ctx.policy.settings, rates),
        exclude=set(two.prefill_exclude),
        ruled_out=two.ruled_out | two.decode_only,
        decided=True,
        affinity=ctx.affinity,
        counts_request=False,
    )


def _prefilled(
    gw: TwoStepPorts, ctx: RequestContext, two: TwoStep, prefill: str, answer: Response
) -> Response | None:
    """A prefill server answered: the transfer params make step 2's body; anything else ends here."""
    if answer.status_code == CLIENT_LEFT:
        gw.metrics.two_step.labels("prefill", "client_disconnect").inc()
        return answer
    if 400 <= answer.status_code < 500 and answer.status_code != 429:
        # The client's own mistake, relayed as in one step.
        gw.metrics.two_step.labels("prefill", "failed").inc()
        _name_failure(answer, "prefill", allocation=False)
        return answer
    if answer.status_code >= 400:
        # The last prefill server could not allocate it: the decode server prefills.
        _no_prefill(gw, ctx, two, answer)
        return None
    try:
        params = transfer_params(orjson.loads(answer.body))
    except orjson.JSONDecodeError:
        params = None
    two.prefill_backend = prefill
    if params is None:
        # Not holding the KV for us (no KV connector there): the decode server recomputes.
        log.warning("request %s: %s returned no kv_transfer_params", ctx.request_id, prefill)
        gw.metrics.two_step.labels("prefill", "no_transfer_params").inc()
        two.skipped = True
        return None
    gw.metrics.two_step.labels("prefill", "ok").inc()
    two.params = params
    raw = orjson.dumps(decode_body(two.body, params))
    ctx.parsed = dataclasses.replace(ctx.parsed, raw=raw)
    return None


def _no_prefill(gw: TwoStepPorts, ctx: RequestContext, two: TwoStep, answer: Response) -> None:
    """No prefill server could take step 1: the decode server computes the prompt itself."""
    log.warning(
        "request %s: no prefill server took it (HTTP %d); the decode server prefills",
        ctx.request_id,
        answer.status_code,
    )
    gw.metrics.two_step.labels("prefill", "failed").inc()
    two.skipped = True


def forward(gw: TwoStepPorts, ctx: RequestContext, decode: str) -> Awaitable[Response | None]:
    """Step 6 on ``decode``: an ordinary attempt, or with SGLang's protocol both halves at once.

    A plain function handing back the attempt's own coroutine: one coroutine fewer on every
    request's path (each level is entered again at every resumption)."""
    two = ctx.two_step
    if two is None or not _sglang(ctx):
        return attempt.forward(gw, ctx, decode)
    return _forward_pair(gw, ctx, two, decode)


async def _forward_pair(
    gw: TwoStepPorts, ctx: RequestContext, two: TwoStep, decode: str
) -> Response | None:
    sub = _prefill_context(gw, ctx, two)
    # Only a server in prefill mode serves a room (one found by discovery without a role
    # label is ``both``: it may take the decode half, never the prefill half).
    sub.ruled_out |= frozenset(b.name for b in ctx.cfg.backends) - two.prefill_only
    try:
        answer = await sglang_pd.forward_pair(gw, ctx, two, decode, sub)
    finally:
        gw.budget.release(sub.retries)
    return answer


def _sglang(ctx: RequestContext) -> bool:
    return ctx.cfg.disaggregation.protocol == "sglang"


def after_divert(gw: TwoStepPorts, ctx: RequestContext, decode: str) -> None:
    """Step 2 on ``decode`` failed before answering: keep the prefilled KV or compute it again."""
    two = ctx.two_step
    if two is None or two.params is None:
        return
    if _sglang(ctx):
        sglang_pd.after_divert(gw, ctx, two, decode)
        return
    if decode in ctx.no_room:
        # Refused for memory before any pull: the prefill server still holds the blocks.
        gw.metrics.two_step.labels("decode", "refused").inc()
        return
    # Anything else may have lost the KV on its way (the prefill server died, the pull broke).
    gw.metrics.two_step.labels("decode", "failed").inc()
    # Step 1 again, elsewhere: that server may be gone (if none is left, the decode prefills).
    two.prefill_exclude.add(two.prefill_backend)
    two.params = None
    ctx.parsed = dataclasses.replace(ctx.parsed, raw=two.raw)


def finish(gw: TwoStepPorts, ctx: RequestContext, answer: Response) -> Response:
    """The request's answer after step 2 (or its placement): counted, and its failed step named."""
    two = ctx.two_step
    if two is None:
        return answer
    if answer.status_code == CLIENT_LEFT:
        gw.metrics.two_step.labels("decode", "client_disconnect").inc()
    elif answer.status_code < 400:
        gw.metrics.two_step.labels("decode", "ok" if two.params is not None else "alone").inc()
    elif answer.headers.get("x-kvroute-failed-step") == "prefill":
        # SGLang's protocol: no prefill server took its half (counted there).
        _name_failure(answer, "prefill", allocation=False)
    else:
        gw.metrics.two_step.labels("decode", "failed").inc()
        allocation = bool(ctx.failed_on) and ctx.failed_on[-1] in ctx.no_room
        _name_failure(answer, "decode", allocation)
    return answer


def _name_failure(answer: Response, step: Step, allocation: bool) -> None:
    """The failed step and its cause, in the answer's headers."""
    answer.headers["x-kvroute-failed-step"] = step
    answer.headers["x-kvroute-failure-cause"] = failure_cause(
        answer.status_code, bytes(answer.body), allocation
    )


def _cached(gw: TwoStepPorts, ctx: RequestContext) -> Mapping[str, int]:
    """Prompt tokens each backend probably caches already (prefix affinity's index)."""
    request = RouteRequest(ctx.demand, ctx.cls)
    view = gw.local.apply(ctx.snap)
    return gw.affinity.route_request(ctx.affinity, request, view, gw.clock()).cached


def end(gw: TwoStepPorts, ctx: RequestContext) -> None:
    """The request's walk ended (any way): a prefill held for it during its hold is no longer counted.

    Blocks a decode server never pulled stay on the prefill server until its own timeout
    (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``); the gateway's bound stops counting them here, when
    it can no longer know (a client gone between the steps is rare; the timeout frees them).
    """
    if ctx.two_step is not None:
        gw.early_prefills.release(ctx.reservation_id)
