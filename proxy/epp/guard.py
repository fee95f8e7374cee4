"""The gateway's request guard on the EPP's streams: the same rules, the same refusals.

``proxy.api.limits.RequestGuard`` is the one home of the limits a request meets before the
walk; the EPP applies its rules through an instance of its own (its own counts: a stream
of the EPP and a request to the HTTP port are counted apart):

- at the headers: their size, one ``Authorization`` header, the API key (431, 400, 401);
- per body chunk: ``limits.max_body_bytes`` (413) and the bodies held at once,
  ``limits.max_buffered_body_bytes`` (429 ``too_many_request_bodies``);
- the body's time: ``limits.body_timeout_s`` plus a second per ``body_min_rate_bytes_s``
  received (408);
- once the body is whole: ``limits.max_concurrent_requests`` (429
  ``too_many_concurrent_requests``). As in the gateway, a client still sending its body
  holds no slot; the slot is held until the stream ends.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import Receive, Scope, Send

from proxy.api.limits import RequestGuard
from proxy.config import Config
from proxy.errors import ApiError


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The guard's rules are used, never the guard as middleware."""


class EppGuard:
    def __init__(self, cfg: Config) -> None:
        self.rules = RequestGuard(_no_app, cfg)
        self.cfg = cfg

    def follow(self, cfg: Config) -> None:
        """The config in force (a reload changes the limits and keys, not the bytes held)."""
        if cfg is not self.cfg:
            self.cfg = cfg
            self.rules.reconfigure(cfg)

    def at_headers(self, headers: Mapping[str, str], path: str) -> ApiError | None:
        raw = [(k.encode(), v.encode()) for k, v in headers.items() if not k.startswith(":")]
        refused = self.rules.header_refusal(raw, path)
        return refused[0] if refused is not None else None

    def take(self, size: int, chunk: bytes) -> None:
        """Admit one chunk (``size``: the body so far); ApiError 413 or 429 when refused."""
        self.rules.take(size, chunk)

    def give(self, held: int) -> None:
        self.rules.budget.give(held)

    def body_deadline(self, started: float, size: int) -> float:
        return self.rules.body_deadline(started, size)

    def body_late(self, size: int, waited_s: float) -> ApiError:
        return self.rules.body_late(size, waited_s)

    def enter(self) -> bool:
        rules = self.rules
        if rules.inflight >= rules.max_concurrent:
            rules.refused["concurrency"] += 1
            return False
        rules.inflight += 1
        return True

    def leave(self) -> None:
        self.rules.inflight -= 1

    def busy(self) -> ApiError:
        return self.rules.busy()
