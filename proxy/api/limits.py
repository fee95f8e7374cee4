"""The guard in front of the API: header size, client API keys, concurrency limit.

A pure ASGI middleware, so that it costs one function call per request and so that the
concurrency count covers a streamed response until its last byte. Every refusal is an
OpenAI-format error: 431 for oversized headers, 401 for a missing or wrong key, 429 with
``Retry-After`` when the gateway already handles ``limits.max_concurrent_requests``.
API keys are compared in constant time, against every configured key, and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.config import Config
from proxy.errors import ApiError

API_PREFIX = "/v1/"


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    return sum(len(k) + len(v) for k, v in headers)


def bearer_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for k, v in headers:
        if k.lower() == b"authorization":
            scheme, _, token = v.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_allowed(presented: bytes | None, keys: list[bytes]) -> bool:
    """Constant time in the presented key: every configured key is compared, no early exit."""
    if presented is None:
        return False
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(presented, k)
    return ok


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        cfg: Config,
        follow: Callable[[Callable[[Config], None]], None] | None = None,
    ) -> None:
        self.app = app
        self.inflight = 0
        self.refused: dict[str, int] = {"headers": 0, "auth": 0, "concurrency": 0}
        self.reconfigure(cfg)
        if follow is not None:
            # A config reload rotates client keys and limits at once.
            follow(self.reconfigure)

    def reconfigure(self, cfg: Config) -> None:
        self.max_header_bytes = cfg.limits.max_header_bytes
        self.max_concurrent = cfg.limits.max_concurrent_requests
        self.retry_after = str(cfg.limits.retry_after_s)
        self.keys = [k.encode() for k in cfg.auth.api_keys]

    async def _refuse(
        self, err: ApiError, why: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.refused[why] += 1
        await err.response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if header_bytes(headers) > self.max_header_bytes:
            err = ApiError(
                431,
                f"request headers are larger than {self.max_header_bytes} bytes",
                code="request_header_fields_too_large",
            )
            await self._refuse(err, "headers", scope, receive, send)
            return
        path: str = scope.get("path", "")
        if not path.startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        if self.keys and not key_allowed(bearer_key(headers), self.keys):
            err = ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )
            await self._refuse(err, "auth", scope, receive, send)
            return
        if self.inflight >= self.max_concurrent:
            err = ApiError(
                429,
                f"the gateway is handling its limit of {self.max_concurrent} concurrent requests; retry shortly",
                type="rate_limit_error",
                code="too_many_concurrent_requests",
                headers={"retry-after": self.retry_after},
            )
            await self._refuse(err, "concurrency", scope, receive, send)
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
