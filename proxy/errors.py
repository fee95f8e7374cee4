"""OpenAI-format error bodies, so every client library shows the gateway's errors properly."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


class ApiError(Exception):
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
        h = dict(self.headers)
        if headers:
            h.update(headers)
        return Response(
            orjson.dumps(self.body()),
            status_code=self.status,
            media_type="application/json",
            headers=h,
        )


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
