"""The EPP's concurrency limit: ``limits.max_concurrent_requests``, as the gateway's guard keeps it.

A request over the limit is shed at its headers with the guard's own 429 (code
``too_many_concurrent_requests``, ``Retry-After``), before its body is buffered. A slot is
held from the headers to the stream's end, as the guard holds one to a stream's last byte.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.api.limits import too_many_concurrent
from proxy.config import Config
from proxy.errors import ApiError


class Shedding:
    """Counts the streams in flight against the limit of the config in force."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self.config = config
        self.inflight = 0

    def enter(self) -> bool:
        if self.inflight >= self.config().limits.max_concurrent_requests:
            return False
        self.inflight += 1
        return True

    def leave(self) -> None:
        self.inflight -= 1

    def busy(self) -> ApiError:
        lim = self.config().limits
        return too_many_concurrent(lim.max_concurrent_requests, str(lim.retry_after_s))
