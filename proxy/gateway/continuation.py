"""A stream whose backend broke after its first byte goes on, on another backend.

Before the first byte a failed attempt diverts (``proxy.gateway.divert``). After it, the
client holds part of an answer; today's gateways end the stream with an error event and the
client starts over, paying the whole generation again. Here the gateway knows what the
client received (``proxy.core.stream_transcript``: only whole events are relayed, each read
once), so it asks another backend to continue exactly there (``proxy.core.continuation``:
the prompt plus the text, or the messages plus the partial assistant message with
``continue_final_message``), and relays that answer into the same client stream.

A continuation is one more placement in the same walk (docs/continuation.md): the request
is re-sized (its prompt grew by the answer so far; ``max_tokens`` shrank by as much), the
broken backend is excluded with the others that failed it, and ``placement.place`` applies
the admission queue, the reservation and the retry budget exactly as to any retry; the
broken part's reservation is released before the next is taken (``StreamRelay.drop_part``),
the last one when the stream ends (``StreamRelay.close``): each once.

What is never continued falls back to today's final error event: see ``not_continuable``
and ``Transcript.blocker``; a total deadline that ran out; more than
``continuation.max_continuations`` breaks; backends of kinds not in ``continuation.kinds``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import orjson
from starlette.responses import Response

from proxy.core.continuation import Splice, continuation_body
from proxy.core.stream_transcript import Transcript
from proxy.core.tokens import count_text
from proxy.core.validation import ParsedRequest, parse_request
from proxy.errors import ApiError
from proxy.gateway import placement
from proxy.gateway.context import RequestContext
from proxy.gateway.continuation_metrics import BreakAction, ContinuationMetrics, Unplaced
from proxy.gateway.continuation_rules import kind_of
from proxy.gateway.first_event import first_event
from proxy.gateway.placement import PlacementPorts
from proxy.gateway.retry_budget import retry_slot
from proxy.gateway.send import SendPorts, send_attempt
from proxy.gateway.sizing import size_request
from proxy.gateway.stream import Break, StreamRelay
from proxy.upstream.client import UpstreamAnswer

log = logging.getLogger("kvroute.gateway")

# Where the access log finds the backends a stream was continued on (proxy.api.access_log).
CONTINUED_ON = "kvroute.continued_on"
# Text longer than this is counted in a thread (tiktoken holds the loop ~1 ms per 4k chars).
COUNT_IN_THREAD_CHARS = 4096
_DONE = b"data: [DONE]\n\n"


class ContinuationPorts(PlacementPorts, SendPorts, Protocol):
    """What a continuation uses: placing and sending like any attempt, and its own counters."""

    continuation_metrics: ContinuationMetrics


@dataclass(frozen=True, slots=True)
class Resumed:
    """A continuation's stream whose first event arrived: ready to relay."""

    backend: str
    resp: UpstreamAnswer
    first: bytes


def _action(relay: StreamRelay, broken: Break, done: int) -> BreakAction:
    ctx, transcript = relay.ctx, relay.transcript
    if transcript is None:
        kind = kind_of(ctx.cfg, relay.backend) or ""
        covered = ctx.cfg.continuation.covers(kind, ctx.parsed.model)
        return "not_continuable" if covered else "off"
    if transcript.complete:
        return "complete"
    if broken.cause == "total_timeout" or transcript.blocker is not None:
        return "not_continuable"
    if done >= ctx.cfg.continuation.max_continuations:
        return "limit_reached"
    return "continued"


async def carry_on(
    gw: ContinuationPorts, relay: StreamRelay, broken: Break | None
) -> AsyncIterator[bytes]:
    """What the client gets after ``broken``: continuations where allowed, else the final event."""
    ctx, transcript = relay.ctx, relay.transcript
    metrics = gw.continuation_metrics
    retries_before = ctx.retries
    # Each continuation is built from what the client asked (plus all it has received).
    original = ctx.parsed
    splice: Splice | None = None
    done = 0
    # A continuation under way (placed or relaying) and not yet counted by its outcome.
    running = False
    try:
        while broken is not None:
            if relay.interrupted:
                # The gateway's drain time is over: no new placement now.
                yield relay.shutdown_event()
                return
            action = _action(relay, broken, done)
            metrics.broke(broken.cause, action)
            if action == "complete":
                if _lacks_done(relay):
                    yield _DONE
                return
            if action != "continued" or transcript is None:
                yield broken.final_event
                return
            if splice is None:
                splice = Splice(ctx.parsed.endpoint, transcript.identity, backends=[relay.backend])
            splice.causes.append(broken.cause)
            running = True
            resumed = await _resume(gw, relay, broken, original, transcript, splice)
            # As for any retry, the budget's slot is held until the answer starts, no longer.
            gw.budget.release(ctx.retries - retries_before)
            retries_before = ctx.retries
            if isinstance(resumed, bytes):
                running = False
                yield resumed
                return
            if isinstance(resumed, str):
                running = False
                metrics.ended(resumed)
                yield broken.final_event
                return
            done += 1
            _switch_to(relay, transcript, splice, resumed)
            async for piece in relay.relay_part(resumed.first, splice.rewrite):
                yield piece
            broken = relay.broken
            running = False
            metrics.ended("completed" if broken is None else "broke_again")
    except (asyncio.CancelledError, GeneratorExit):
        if running:
            metrics.ended("client_left")
        raise
    finally:
        # The retries this stream took from the budget (the walk gave back its own already).
        gw.budget.release(ctx.retries - retries_before)


def _lacks_done(relay: StreamRelay) -> bool:
    """A stream broken after its finish reason: only the bookkeeping after it was lost, so it
    succeeded; True when the client still needs the ``[DONE]`` line."""
    relay.outcome = "success"
    return relay.transcript is not None and not relay.transcript.done


def _switch_to(
    relay: StreamRelay, transcript: Transcript, splice: Splice, resumed: Resumed
) -> None:
    """The relay goes on with the continuation's stream, on its backend, as the next part."""
    ctx = relay.ctx
    splice.backends.append(resumed.backend)
    ctx.request.scope.setdefault(CONTINUED_ON, []).append(resumed.backend)
    relay.resp, relay.backend, relay.holds = resumed.resp, resumed.backend, True
    ctx.backend = resumed.backend
    transcript.next_part()


async def _resume(
    gw: ContinuationPorts,
    relay: StreamRelay,
    broken: Break,
    original: ParsedRequest,
    transcript: Transcript,
    splice: Splice,
) -> Resumed | bytes | Unplaced:
    """The next part's stream; bytes when nothing is left to generate (the final chunk);
    else why no backend took it."""
    ctx = relay.ctx
    relay.drop_part()
    sent = await _tokens_sent(transcript)
    splice.earlier_tokens = sent
    body = continuation_body(original.body, original.endpoint, transcript.text, sent)
    if body is None:
        relay.outcome = "success"
        return _last_chunk(ctx, transcript) + _DONE
    log.info(
        "request %s: continuing the stream broken on %s (%s) after %d tokens",
        ctx.request_id,
        relay.backend,
        broken.cause,
        sent,
    )
    gw.continuation_metrics.added.inc(sent)
    try:
        await _resize(ctx, body)
    except ApiError as exc:
        log.warning("request %s: continuation refused: %s", ctx.request_id, exc)
        return "refused"
    return await _place(gw, relay)


async def _tokens_sent(transcript: Transcript) -> int:
    """Tokens the client received: the text counted, never fewer than the events that carried it."""
    text = transcript.text
    if len(text) > COUNT_IN_THREAD_CHARS:
        counted = await asyncio.to_thread(count_text, text)
    else:
        counted = count_text(text)
    return max(counted, transcript.text_events)


async def _resize(ctx: RequestContext, body: dict[str, object]) -> None:
    """The continuation is sized like any request: its prompt grew, its output shrank."""
    raw = orjson.dumps(body)
    ctx.parsed = parse_request(raw, ctx.parsed.endpoint, ctx.cfg.routing.max_tokens_limit)
    sized = await size_request(ctx.parsed, ctx.cfg)
    ctx.prompt_tokens, ctx.demand = sized.prompt_tokens, sized.total


async def _place(gw: ContinuationPorts, relay: StreamRelay) -> Resumed | Unplaced:
    """Place and start the continuation (the walk's place/attempt/move_on loop)."""
    ctx = relay.ctx
    ctx.exclude.add(relay.backend)
    ctx.exclude |= {b.name for b in ctx.cfg.backends if b.kind not in ctx.cfg.continuation.kinds}
    ctx.failed_on.append(relay.backend)
    if not await retry_slot(gw, ctx):
        return "budget_exhausted"
    # The slot is taken: this first placement is not charged again (later diverts are).
    ctx.failure = None
    ctx.snap = await gw.fleet.snapshot()
    while True:
        placed = await placement.place(gw, ctx)
        if isinstance(placed, Response):
            # placement's answer (give_up, nothing_fits) counted the request already.
            relay.counted = True
            return "no_backend"
        got = await send_attempt(gw, ctx, placed, _first_event)
        if isinstance(got, Resumed):
            return got
        if isinstance(got, Response):
            # An answer that is not a stream (the backend refused the continuation).
            relay.counted = True
            return "refused"
        await placement.move_on(gw, ctx, placed)


async def _first_event(
    gw: ContinuationPorts,
    ctx: RequestContext,
    backend: str,
    resp: UpstreamAnswer,
    started: float,
    ttfb_deadline: float,
) -> Resumed | None:
    first = await first_event(gw, ctx, backend, resp, ttfb_deadline)
    return None if first is None else Resumed(backend, resp, first)


def _last_chunk(ctx: RequestContext, transcript: Transcript) -> bytes:
    """The finish the broken part never sent: its limit was reached as it broke."""
    chat = ctx.parsed.endpoint == "chat"
    choice: dict[str, object] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    obj = {
        **transcript.identity,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"
