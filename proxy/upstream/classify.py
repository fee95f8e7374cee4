"""Classify what a backend answered: an allocation failure to divert, or something else.

The simulated engine's documented error (proxy.core.backend_contract) is recognised exactly;
other servers' capacity errors (vLLM/TGI/custom) by status and well-known phrases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from proxy.core import backend_contract as bc

Verdict = Literal["ok", "allocation", "overload", "server_error", "client_error"]

_ALLOC_PHRASES = (
    b"kv cache",
    b"kv-cache",
    b"out of memory",
    b"no available memory for the cache blocks",
    b"insufficient kv",
    b"cannot allocate",
    b"allocation fail",
)


@dataclass(frozen=True, slots=True)
class UpstreamVerdict:
    verdict: Verdict
    free_tokens: int | None = None
    largest_free_block_tokens: int | None = None
    retry_after_s: float | None = None
    message: str = ""


def _numbers(err: dict[str, object]) -> tuple[int | None, int | None]:
    def num(key: str) -> int | None:
        v = err.get(key)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    return num("free_tokens"), num("largest_free_block_tokens")


def classify_response(status: int, body: bytes, retry_after: str | None = None) -> UpstreamVerdict:
    """Decide what an upstream status + body means for routing."""
    if status < 400:
        return UpstreamVerdict("ok")
    ra: float | None = None
    if retry_after:
        try:
            ra = max(0.0, float(retry_after))
        except ValueError:
            ra = None
    err: dict[str, object] = {}
    try:
        parsed = orjson.loads(body) if body else None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            err = parsed["error"]
    except orjson.JSONDecodeError:
        pass
    message = str(err.get("message", ""))[:500]
    if err.get("type") == bc.ALLOCATION_ERROR_TYPE or err.get("code") == bc.ALLOCATION_ERROR_CODE:
        free, largest = _numbers(err)
        return UpstreamVerdict("allocation", free, largest, ra, message)
    lowered = body[:4096].lower()
    if status in (500, 503, 507) and any(p in lowered for p in _ALLOC_PHRASES):
        return UpstreamVerdict("allocation", None, None, ra, message)
    if status in (429, 503):
        return UpstreamVerdict("overload", None, None, ra, message)
    if status >= 500:
        return UpstreamVerdict("server_error", None, None, ra, message)
    return UpstreamVerdict("client_error", None, None, ra, message)


# Lines an SSE stream may begin with (WHATWG HTML, server-sent events): a field or a comment.
_SSE_STARTS = (b"data:", b"event:", b"id:", b"retry:", b":", b"\n", b"\r")


def json_object(body: bytes) -> dict[str, Any] | None:
    """The answer as a JSON object; None when it is anything else (garbage to divert).

    A 2xx answer to an OpenAI endpoint is a JSON object. The parsed object is handed on, so
    that what reads the answer's usage does not parse it again.
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def is_json_object(body: bytes) -> bool:
    """A 2xx answer to an OpenAI endpoint is a JSON object; anything else is garbage to divert."""
    return json_object(body) is not None


def looks_like_sse(first_chunk: bytes) -> bool:
    """Does the first piece of a streamed 2xx body look like server-sent events?"""
    return first_chunk.lstrip(b"\xef\xbb\xbf").startswith(_SSE_STARTS)
