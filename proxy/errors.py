"""Every kvroute error, drawn in one place, and the OpenAI-format bodies the client sees.

The hierarchy (the httpx ``_exceptions.py`` habit: one base, the whole tree in one module)::

    KvrouteError
    ├── ConfigError            a config file that cannot be used (names key and value)
    ├── StoreUnavailable       the state store did not answer within its deadline
    ├── ScrapeError            a backend's metrics could not become a memory report
    ├── RestartRefused         a manual restart/drain that cannot start now (``reason``)
    ├── RestartFailed          a restart under way that cannot finish (hook, store, timeout)
    ├── KubernetesApiError     a non-2xx answer (``status``) or an unreachable API server
    ├── WatchExpired           a Kubernetes watch's resourceVersion is gone (HTTP 410)
    ├── WireError              the lean client's connection, below the upstream boundary
    │   ├── ConnectionLost         closed before the answer ended
    │   └── BadAnswer              bytes that are not an HTTP/1.1 answer
    ├── UpstreamError          a backend failed us before anything reached the client
    │   ├── UpstreamTimeout        no response headers in time (connect or TTFB)
    │   ├── UpstreamConnectError   refused or dropped before answering
    │   ├── BodyTimeout            the body stalled (idle gap) or ran past the total limit
    │   ├── UpstreamBroken         the connection broke while the body was being read
    │   └── AnswerTooLarge         a whole answer above ``upstream.max_answer_bytes``
    └── ApiError               an error answered to the client as OpenAI-format JSON

Library errors (aiohttp, OSError) and the lean client's ``WireError`` are translated into
``UpstreamError`` inside ``proxy.upstream`` (``client``, ``lean``); nothing above it catches
a library's exceptions. Only ``ApiError``
carries an HTTP status: the domain errors carry a kind, and the layer that answers HTTP maps
the kind to a status (``UPSTREAM_ANSWERS`` below, ``proxy.api.admin`` for restarts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import orjson

if TYPE_CHECKING:
    from starlette.responses import Response


class KvrouteError(Exception):
    """Base of every error kvroute raises on purpose."""


class ConfigError(KvrouteError):
    """A config file that cannot be used; the message names each offending key and value."""


class StoreUnavailable(KvrouteError):
    """The store did not answer within its deadline (after one retry)."""


class ScrapeError(KvrouteError):
    """A backend's metrics could not be turned into a memory report; ``reason`` says why.

    ``cause`` is the failure's kind, one of a few fixed words (``ScrapeCause``): what the
    ``kvroute_scrapes_total`` counter is labelled with, where the free-text reason would
    make a new series per message.
    """

    def __init__(self, reason: str, cause: str = "bad_metrics") -> None:
        super().__init__(reason)
        self.reason = reason
        self.cause = cause


RefusalReason = Literal["unknown_backend", "conflict", "store_unavailable"]


class RestartRefused(KvrouteError):
    """A manual restart or drain that cannot happen now; ``reason`` says which kind of no."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason: RefusalReason = reason
        self.message = message


class RestartFailed(KvrouteError):
    """A restart under way cannot finish; the node goes back into service (proxy.ops.restart)."""


class KubernetesApiError(KvrouteError):
    """A non-2xx answer from the Kubernetes API (``status`` is the HTTP code; 0: unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"kubernetes api: HTTP {status}: {message}" if status else message)
        self.status = status


class WatchExpired(KvrouteError):
    """The watch's resourceVersion is gone (HTTP 410 or an ERROR event with code 410)."""


class WireError(KvrouteError):
    """The lean upstream client's connection failed (proxy.upstream.wire); ``proxy.upstream``
    turns it into ``UpstreamBroken``, so nothing above that package sees it."""


class ConnectionLost(WireError):
    """The backend closed the connection, or it was closed under us, before the answer ended."""


class BadAnswer(WireError):
    """The backend's bytes are not an HTTP/1.1 answer (the parser refused them)."""


# What went wrong with one upstream attempt; keys of UPSTREAM_ANSWERS.
UpstreamFailure = Literal[
    "connect_timeout",
    "ttfb_timeout",
    "connect_error",
    "idle_timeout",
    "total_timeout",
    "first_event_timeout",
    "broken",
    "bad_response",
]


class UpstreamError(KvrouteError):
    """A backend failed before anything reached the client; ``failure`` names how."""

    failure: UpstreamFailure = "broken"


class UpstreamTimeout(UpstreamError):
    """A timeout before anything reached the client: ``phase`` is "connect" or "ttfb"."""

    def __init__(self, message: str, phase: Literal["connect", "ttfb"] = "ttfb") -> None:
        super().__init__(message)
        self.phase = phase
        self.failure = "connect_timeout" if phase == "connect" else "ttfb_timeout"


class UpstreamConnectError(UpstreamError):
    """The backend refused or dropped the connection before answering."""

    failure: UpstreamFailure = "connect_error"


class BodyTimeout(UpstreamError):
    """The body stopped: ``phase`` is "idle" (gap between chunks) or "total" (whole request)."""

    def __init__(self, message: str, phase: Literal["idle", "total"]) -> None:
        super().__init__(message)
        self.phase = phase
        self.failure = "idle_timeout" if phase == "idle" else "total_timeout"


class UpstreamBroken(UpstreamError):
    """The connection broke mid-body; ``cause`` names the library's exception class."""

    failure: UpstreamFailure = "broken"

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class AnswerTooLarge(UpstreamError):
    """A non-streamed answer went past ``upstream.max_answer_bytes``: refused as a bad response."""

    failure: UpstreamFailure = "bad_response"


# Upstream failure -> (HTTP status, error code) of the client's answer.
UPSTREAM_ANSWERS: dict[UpstreamFailure, tuple[int, str]] = {
    "connect_timeout": (504, "upstream_connect_timeout"),
    "ttfb_timeout": (504, "upstream_timeout"),
    "connect_error": (502, "upstream_unavailable"),
    "idle_timeout": (504, "upstream_idle_timeout"),
    "total_timeout": (504, "upstream_total_timeout"),
    # Before the first event a stream's timeout is one kind, whatever the phase.
    "first_event_timeout": (504, "upstream_timeout"),
    "broken": (502, "upstream_broken"),
    "bad_response": (502, "upstream_bad_response"),
}


class ApiError(KvrouteError):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        err.update(self.extra)
        return {"error": err}

    def response(self, headers: dict[str, str] | None = None) -> Response:
        # Imported here: the base layer stays free of the web stack (the simulator and the
        # pure modules import this one).
        from starlette.responses import Response

        h = dict(self.headers)
        if headers:
            h.update(headers)
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=h,
        )


def upstream_answer(failure: UpstreamFailure, message: str) -> Response:
    """The client's answer for an upstream failure, status and code from ``UPSTREAM_ANSWERS``."""
    status, code = UPSTREAM_ANSWERS[failure]
    return ApiError(status, message, type="upstream_error", code=code).response()


def bad_request(
    message: str, param: str | None = None, code: str | None = None, status: int = 400
) -> ApiError:
    return ApiError(status, message, param=param, code=code)


def sse_error_event(message: str, type: str = "upstream_error", code: str | None = None) -> bytes:
    """The final event of a stream that failed after bytes already reached the client."""
    payload = orjson.dumps(
        {"error": {"message": message, "type": type, "param": None, "code": code}}
    )
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
