"""Per-model request limits as the backends enforce them, answered in their own words.

A server rejects a request longer than its ``max_model_len`` (from ``GET /v1/models``) with
a 400. The gateway checks the same limit first, so it never sends what every backend would
refuse, and never refuses what a backend would accept (its old check compared the request
with the whole KV cache, which is neither). The wording follows vLLM's, which clients match
on ("maximum context length"). An unknown model gets OpenAI's 404 ``model_not_found``,
listing what the fleet serves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LimitError:
    """An OpenAI-format error: HTTP status and the ``error`` object's fields."""

    status: int
    message: str
    type: str
    param: str | None
    code: str

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def context_length_error(
    max_model_len: int | None, prompt_tokens: int, max_tokens: int, max_tokens_given: bool
) -> LimitError | None:
    """None when ``prompt + max_tokens`` fits ``max_model_len`` (or the limit is unknown)."""
    if max_model_len is None or prompt_tokens + max_tokens <= max_model_len:
        return None
    if prompt_tokens >= max_model_len or not max_tokens_given:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of the input "
            "messages."
        )
        param = "messages"
    else:
        message = (
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
            f"maximum context length is {max_model_len} tokens and your request has "
            f"{prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})."
        )
        param = "max_tokens"
    return LimitError(400, message, "BadRequestError", param, "context_length_exceeded")


def model_not_found(model: str, served: Iterable[str]) -> LimitError:
    names = sorted(set(served))
    listed = ", ".join(names) if names else "none"
    return LimitError(
        404,
        f"The model `{model}` does not exist. Models served here: {listed}.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def fleet_max_model_len(limits: Iterable[int | None]) -> int | None:
    """The limit a request must meet to be servable somewhere: the largest known one."""
    known = [x for x in limits if x]
    return max(known) if known else None
