"""The OpenAI wire format as the simulated engine speaks it: validation, bodies, errors, text.

Kept apart from the server so the handlers read as the engine's behaviour (allocate, wait,
free) and this module as the protocol. Validation follows what vLLM's OpenAI server
rejects, with 400 and an OpenAI-style ``{"error": {message, type, param, code}}`` body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from loadtest.workload import WORDS
from proxy.core import backend_contract as contract


class BadRequest(Exception):
    """A request the engine refuses with 400 (or ``status``), OpenAI-style."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.type = type_


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None, **extra: Any
) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}
    )


def allocation_error_body(demand: int, free: int, largest: int, allocator: str) -> bytes:
    """The body of the documented allocation failure (HTTP 503), numbers included."""
    return error_body(
        f"KV cache allocation failed: the request needs {demand} tokens but the largest free "
        f"block is {largest} tokens ({free} tokens free in total, {allocator} allocator)",
        contract.ALLOCATION_ERROR_TYPE,
        None,
        contract.ALLOCATION_ERROR_CODE,
        demand_tokens=demand,
        free_tokens=free,
        largest_free_block_tokens=largest,
    )


@dataclass(frozen=True, slots=True)
class Parsed:
    """What the engine needs from a validated body."""

    chat: bool
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _max_tokens(body: dict[str, Any], chat: bool, default: int) -> int:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v):
            raise BadRequest(
                f"{name} must be an integer, got {type(v).__name__}", name, "invalid_type"
            )
        if v < 1:
            raise BadRequest(f"{name} must be at least 1, got {v}", name, "invalid_value")
        return int(v)
    return default


def _check_prompt(prompt: Any) -> None:
    if prompt is None:
        raise BadRequest("'prompt' is a required property", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(_is_int(p) and p >= 0 for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return
    raise BadRequest(
        "prompt must be a string, a non-empty list of strings, or token ids",
        "prompt",
        "invalid_type",
    )


def _check_messages(messages: Any) -> None:
    if messages is None:
        raise BadRequest(
            "'messages' is a required property", "messages", "missing_required_parameter"
        )
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array", "messages", "invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", f"messages.[{i}]", "invalid_type")
        if not isinstance(m.get("role"), str):
            raise BadRequest(
                f"messages[{i}].role must be a string", f"messages.[{i}].role", "invalid_type"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array of parts",
                f"messages.[{i}].content",
                "invalid_type",
            )
        if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
            raise BadRequest(
                f"messages[{i}].content parts must be objects",
                f"messages.[{i}].content",
                "invalid_type",
            )


def parse_body(raw: bytes, chat: bool, default_max_tokens: int) -> tuple[dict[str, Any], Parsed]:
    """Decode and validate a completions or chat body; raises :class:`BadRequest`."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is a required property", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise BadRequest("model must be a non-empty string", "model", "invalid_type")
    if chat:
        _check_messages(body.get("messages"))
    else:
        _check_prompt(body.get("prompt"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream", "invalid_type")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", "stream_options", "invalid_type")
    include_usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
    max_tokens = _max_tokens(body, chat, default_max_tokens)
    return body, Parsed(chat, model, bool(stream), include_usage, max_tokens)


# --- generated text --------------------------------------------------------------------

_TOKENS = [" " + w for w in WORDS]  # each exactly one cl100k token
_N = len(_TOKENS)
_TWICE = "".join(_TOKENS) * 2
_OFFS = [0]
for _t in _TOKENS * 2:
    _OFFS.append(_OFFS[-1] + len(_t))
_CYCLE_CHARS = _OFFS[_N]


def generated_text(start: int, n: int) -> str:
    """``n`` tokens of filler text, token ``start`` onwards of an endless word cycle."""
    if n <= 0:
        return ""
    s = start % _N
    full, rest = divmod(n, _N)
    head = _TWICE[_OFFS[s] : _OFFS[s] + _CYCLE_CHARS] * full if full else ""
    return head + _TWICE[_OFFS[s] : _OFFS[s + rest]]


# --- response bodies -------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_body(completion_id: str, created: int, p: Parsed, text: str, prompt_tokens: int) -> bytes:
    if p.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "length",
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": completion_id,
            "object": obj,
            "created": created,
            "model": p.model,
            "choices": [choice],
            "usage": usage(prompt_tokens, p.max_tokens),
        }
    )


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def chunk(
    completion_id: str,
    created: int,
    p: Parsed,
    text: str | None,
    finish: str | None,
    role: bool = False,
) -> bytes:
    """One streamed chunk: a text delta (or the chat role opener) and maybe the finish reason."""
    if p.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        elif text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body: dict[str, Any] = {
        "id": completion_id,
        "object": obj,
        "created": created,
        "model": p.model,
        "choices": [choice],
    }
    if p.include_usage:
        body["usage"] = None
    return sse(body)


def usage_chunk(
    completion_id: str, created: int, p: Parsed, prompt_tokens: int, cached: int | None = None
) -> bytes:
    """The final usage chunk; ``cached``: prompt tokens served from the prefix cache, as vLLM
    reports them (``prompt_tokens_details.cached_tokens``)."""
    obj = "chat.completion.chunk" if p.chat else "text_completion"
    counts: dict[str, Any] = dict(usage(prompt_tokens, p.max_tokens))
    if cached is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
    return sse(
        {
            "id": completion_id,
            "object": obj,
            "created": created,
            "model": p.model,
            "choices": [],
            "usage": counts,
        }
    )
