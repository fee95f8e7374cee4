"""An optional access log: one line per inference request, when it has ended.

``log.access_log: true`` turns it on (off by default: at thousands of requests per second a
line each is a cost some deployments do not want). Each line carries what an operator asks
first about one request: its id, model, class, KV demand, the backend that served it, how
many attempts it took, the status and the duration (to the last byte, streams included).
Everything but the model comes from the gateway's own response headers; the model is read
from the start of the body as it passes (no second parse of the JSON). Values are bounded
and stripped of control characters, since ids and model names come from clients.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.config import Config

# The scope key proxy.gateway.continuation fills (not imported: nothing here needs the gateway).
CONTINUED_ON = "kvroute.continued_on"

log = logging.getLogger("kvroute.access")

API_PREFIX = "/v1/"
_MODEL = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){0,200})"')
_UNSAFE = re.compile(r"[^\x21-\x7e]")
_HEADERS = {
    b"x-request-id": "id",
    b"x-kvroute-class": "class",
    b"x-kvroute-demand-tokens": "demand",
    b"x-kvroute-backend": "backend",
    b"x-kvroute-attempts": "attempts",
}
# The model is usually the first key; look no further than this into the body.
PEEK_BYTES = 4096


def clean(value: str, limit: int = 128) -> str:
    """Printable ASCII without spaces, at most ``limit`` characters: one token per field."""
    return _UNSAFE.sub("?", value[:limit]) or "-"


def fields_of(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The line's fields the gateway's own response headers carry (id, class, backend...)."""
    fields: dict[str, str] = {}
    for name, value in headers:
        key = _HEADERS.get(name.lower())
        if key is not None:
            fields[key] = value.decode("latin-1")
    return fields


def continued_fields(scope: Scope) -> dict[str, str]:
    """A stream continued on other backends (proxy.gateway.continuation) names them too."""
    continued = scope.get(CONTINUED_ON)
    return {"continued_on": ",".join(continued)} if continued else {}


class AccessLog:
    """ASGI middleware; a no-op pass-through unless the config enables it."""

    def __init__(
        self,
        app: ASGIApp,
        cfg: Config,
        follow: Callable[[Callable[[Config], None]], None] | None = None,
    ) -> None:
        self.app = app
        self.reconfigure(cfg)
        if follow is not None:
            follow(self.reconfigure)

    def reconfigure(self, cfg: Config) -> None:
        self.enabled = cfg.log.access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.enabled or scope["type"] != "http" or not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        head = bytearray()
        fields: dict[str, str] = {}
        status = 0

        async def tap_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(head) < PEEK_BYTES:
                head.extend(message.get("body", b"")[: PEEK_BYTES - len(head)])
            return message

        async def tap_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                fields.update(fields_of(message.get("headers", [])))
            await send(message)

        try:
            await self.app(scope, tap_receive, tap_send)
        finally:
            fields.update(continued_fields(scope))
            self.write(scope["path"], bytes(head), fields, status, time.perf_counter() - started)

    def write(
        self, path: str, head: bytes, fields: dict[str, str], status: int, seconds: float
    ) -> None:
        """One line. ``head``: the body's first bytes (``PEEK_BYTES``, for the model);
        ``fields``: from the response's headers (``fields_of``); status 0: no response."""
        m = _MODEL.search(head)
        model = m.group(1).decode("utf-8", "replace") if m else "-"
        values = {
            "id": clean(fields.get("id", "-")),
            "model": clean(model),
            "class": clean(fields.get("class", "-")),
            "demand": clean(fields.get("demand", "-")),
            "backend": clean(fields.get("backend", "-")),
            "attempts": clean(fields.get("attempts", "-")),
            **({"continued_on": clean(fields["continued_on"])} if "continued_on" in fields else {}),
            # 0: the client went away before any response started.
            "status": str(status),
            "duration_ms": f"{seconds * 1000:.1f}",
        }
        log.info(
            "%s %s",
            path,
            " ".join(f"{k}={v}" for k, v in values.items()),
            extra={"access": values},
        )
