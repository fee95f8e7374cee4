"""The inference routes' entries in the OpenAPI document (served to the admin key only).

The routes read the raw body themselves (proxy.api.entry), so FastAPI cannot derive these:
the schemas say what a client must send; the gateway validates only what routing needs
(proxy.core.validation) and forwards the exact bytes.
"""

from __future__ import annotations

from typing import Any

CHAT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            },
        },
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
    },
}
COMPLETIONS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
    },
}


def _post(summary: str, operation_id: str, schema: dict[str, Any]) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    ok = {"description": "Successful Response", "content": {"application/json": {"schema": {}}}}
    return {
        "post": {
            "summary": summary,
            "operationId": operation_id,
            "requestBody": body,
            "responses": {"200": ok},
        }
    }


def inference_paths() -> dict[str, Any]:
    """The two inference routes as OpenAPI path items."""
    return {
        "/v1/chat/completions": _post("Chat", "chat_v1_chat_completions_post", CHAT_SCHEMA),
        "/v1/completions": _post(
            "Completions", "completions_v1_completions_post", COMPLETIONS_SCHEMA
        ),
    }
