"""When a broken stream may be continued, and how long a stream may stay silent.

Read by the relay (``proxy.gateway.stream``) for every stream, and by the continuation
itself (``proxy.gateway.continuation``); kept apart from the continuation so the relay
does not import the step that drives it.
"""

from __future__ import annotations

from proxy.config import Config
from proxy.core.continuation import not_continuable
from proxy.core.stream_transcript import Transcript
from proxy.gateway.context import RequestContext
from proxy.gateway.continuation_metrics import BreakCause


def kind_of(cfg: Config, backend: str) -> str | None:
    for b in cfg.backends:
        if b.name == backend:
            return b.kind
    return None


def transcript_for(ctx: RequestContext, backend: str) -> Transcript | None:
    """A transcript to read the stream with when it may be continued; None when it may not."""
    parsed = ctx.parsed
    kind = kind_of(ctx.cfg, backend)
    if kind is None or not ctx.cfg.continuation.covers(kind, parsed.model):
        return None
    if not_continuable(parsed.body, parsed.endpoint) is not None:
        return None
    return Transcript(parsed.endpoint)


def stall_timeout(ctx: RequestContext, continuable: bool) -> float:
    """The longest silence between events: ``continuation.stall_timeout_s`` where it applies."""
    stall = ctx.cfg.continuation.stall_timeout_s
    return stall if continuable and stall is not None else ctx.cfg.upstream.idle_timeout_s


def break_cause(cause: str) -> BreakCause:
    return "ended_early" if cause.startswith("the stream ended") else "reset"
