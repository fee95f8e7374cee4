"""Validate an OpenAI request body before anything is routed or reserved.

Only what the gateway needs to size and route the request is checked strictly (model,
messages/prompt, max tokens, stream); everything else passes through untouched for the
backend to judge. Hand-written checks rather than a pydantic model on purpose: this runs
on every request and must cost microseconds, and the error must name the exact param.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from proxy.errors import ApiError, bad_request

Endpoint = Literal["chat", "completions"]
_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer", "ipython"})
_MAX_MESSAGES = 100_000


# weakref_slot: sizing hands the prompt's prefix hashes to affinity by a weak reference.
@dataclass(frozen=True, slots=True, weakref_slot=True)
class ParsedRequest:
    body: dict[str, Any]
    raw: bytes
    endpoint: Endpoint
    model: str
    stream: bool
    #: Output per sequence as given (``max_completion_tokens`` wins); None: the default applies.
    max_tokens: int | None
    #: Sequences per prompt, ``max(n, best_of)``: each holds its own output KV.
    sequences: int = 1

    @property
    def max_new_tokens(self) -> int | None:
        """Output over all sequences of one prompt when given; None when the default applies."""
        return None if self.max_tokens is None else self.max_tokens * self.sequences


def _check_int(body: dict[str, Any], key: str, limit: int, least: int = 1) -> int | None:
    if key not in body or body[key] is None:
        return None
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(
            f"'{key}' must be an integer, got {type(v).__name__}", param=key, code="invalid_type"
        )
    if v < least:
        raise bad_request(
            f"'{key}' must be at least {least}, got {v}", param=key, code="invalid_value"
        )
    if v > limit:
        raise bad_request(
            f"'{key}' is {v}, above this gateway's limit of {limit}",
            param=key,
            code="invalid_value",
        )
    return v


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise bad_request(
            "'messages' must be an array of message objects", param="messages", code="invalid_type"
        )
    if not messages:
        raise bad_request(
            "'messages' must contain at least one message", param="messages", code="invalid_value"
        )
    if len(messages) > _MAX_MESSAGES:
        raise bad_request(
            f"'messages' has more than {_MAX_MESSAGES} entries",
            param="messages",
            code="invalid_value",
        )
    for i, m in enumerate(messages):
        _check_message(m, f"messages[{i}]")


def _check_message(m: Any, where: str) -> None:
    """One message: an object with a known role and content (a string or an array of parts)."""
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object", param=where, code="invalid_type")
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_request(
            f"'{where}.role' must be one of {sorted(_ROLES)}",
            param=f"{where}.role",
            code="invalid_value",
        )
    _check_message_fields(m, where)
    content = m.get("content")
    if content is None:
        if role == "assistant":
            return  # assistant messages with tool_calls may have no content
        raise bad_request(
            f"'{where}.content' is required",
            param=f"{where}.content",
            code="missing_required_parameter",
        )
    if isinstance(content, str):
        return
    if isinstance(content, list):
        _check_parts(content, where)
        return
    raise bad_request(
        f"'{where}.content' must be a string or an array of parts",
        param=f"{where}.content",
        code="invalid_type",
    )


def _check_parts(content: list[Any], where: str) -> None:
    """A message's content parts: objects with a ``type`` (bare strings read as text)."""
    for j, part in enumerate(content):
        if isinstance(part, str):
            # A bare string part: servers (vLLM) read it as a text part.
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(
                f"'{where}.content[{j}]' must be an object with a 'type'",
                param=f"{where}.content[{j}]",
                code="invalid_type",
            )
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise bad_request(
                f"'{where}.content[{j}].text' must be a string",
                param=f"{where}.content[{j}].text",
                code="invalid_type",
            )


def _check_message_fields(m: dict[str, Any], where: str) -> None:
    """Fields that are counted must have the type they are counted as."""
    for key in ("name", "tool_call_id"):
        if key in m and m[key] is not None and not isinstance(m[key], str):
            raise bad_request(
                f"'{where}.{key}' must be a string", param=f"{where}.{key}", code="invalid_type"
            )
    calls = m.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
    ):
        raise bad_request(
            f"'{where}.tool_calls' must be an array of objects",
            param=f"{where}.tool_calls",
            code="invalid_type",
        )


def _check_tools(body: dict[str, Any]) -> None:
    for key in ("tools", "functions"):
        tools = body.get(key)
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise bad_request(
                f"'{key}' must be an array of objects", param=key, code="invalid_type"
            )


def _check_prompt_embeds(emb: Any) -> None:
    if isinstance(emb, str) and emb:
        return
    if isinstance(emb, list) and emb and all(isinstance(e, str) and e for e in emb):
        return
    raise bad_request(
        "'prompt_embeds' must be a base64 string or an array of them",
        param="prompt_embeds",
        code="invalid_type",
    )


def _check_sequences(body: dict[str, Any]) -> int:
    """``max(n, best_of)``: the sequences each prompt runs (each with its own output KV)."""
    seqs = 1
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > 128):
            raise bad_request(
                f"'{key}' must be an integer between 1 and 128", param=key, code="invalid_value"
            )
        if isinstance(v, int):
            seqs = max(seqs, v)
    return seqs


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return
        if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
            return
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            for p in prompt
        ):
            return
    raise bad_request(
        "'prompt' must be a string, an array of strings, or an array of token ids",
        param="prompt",
        code="invalid_type",
    )


def parse_request(
    raw: bytes, endpoint: Endpoint, max_tokens_limit: int, content_type: str | None = None
) -> ParsedRequest:
    """Parse and validate; raise ApiError (4xx, OpenAI format) on anything the gateway cannot route."""
    body = _json_object(raw, content_type)
    model = _check_model(body)
    if endpoint == "chat":
        _check_chat_input(body)
    else:
        _check_completion_input(body)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream", code="invalid_type")

    sequences = _check_sequences(body)
    # max_tokens 0 with echo scores the prompt without generating (completions only).
    least = 0 if endpoint == "completions" and body.get("echo") is True else 1
    given = _check_int(body, "max_completion_tokens", max_tokens_limit, least)
    legacy = _check_int(body, "max_tokens", max_tokens_limit, least)
    # The newer name wins when both are given, as in vLLM and OpenAI.
    max_tokens = given if given is not None else legacy
    return ParsedRequest(
        body=body,
        raw=raw,
        endpoint=endpoint,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        sequences=sequences,
    )


def _json_object(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """The body as a JSON object: 415 for another media type, 400 for anything else."""
    if content_type is not None:
        ct = content_type.split(";", 1)[0].strip().lower()
        if ct and ct != "application/json" and not ct.endswith("+json"):
            raise ApiError(
                415,
                f"Content-Type must be application/json, got {ct!r}",
                code="unsupported_media_type",
            )
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body


def _check_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request(
            "you must provide a model parameter", param="model", code="missing_required_parameter"
        )
    if not isinstance(model, str) or not model.strip():
        raise bad_request("'model' must be a non-empty string", param="model", code="invalid_type")
    return model


def _check_chat_input(body: dict[str, Any]) -> None:
    if "messages" not in body:
        raise bad_request(
            "'messages' is a required property",
            param="messages",
            code="missing_required_parameter",
        )
    _check_messages(body["messages"])
    _check_tools(body)


def _check_completion_input(body: dict[str, Any]) -> None:
    if "prompt" not in body and body.get("prompt_embeds") is None:
        raise bad_request(
            "'prompt' is a required property", param="prompt", code="missing_required_parameter"
        )
    if "prompt" in body:
        _check_prompt(body["prompt"])
    if body.get("prompt_embeds") is not None:
        _check_prompt_embeds(body["prompt_embeds"])
