"""Continuing a broken stream on another backend: which requests can be, and the request
and events that do it. Pure logic, no I/O (the gateway's ``proxy.gateway.continuation`` runs it).

vLLM and SGLang continue a partial answer when asked right:

* completions: the prompt plus the text generated so far, as a new prompt;
* chat: the messages plus the partial assistant message, with ``continue_final_message:
  true`` and ``add_generation_prompt: false`` (vLLM's chat parameters: the template leaves
  the last message open instead of starting a new turn; the two cannot both be true).

``max_tokens`` (or ``max_completion_tokens``) is reduced by the tokens already sent, so the
whole answer is no longer than asked. Completions without one get OpenAI's default of 16.

Never continued (``not_continuable``): several choices (``n``/``best_of`` > 1, several
prompts), log-probabilities, ``echo``, token-id prompts, and structured output (a grammar
would restart from the beginning of the document). What the stream itself shows (a tool
call, reasoning) is ``Transcript.blocker``'s business.

The continuation's events are rewritten into the first stream: the same ``id``, ``created``
and ``model``; no second role opener; usage counted over both parts; and a ``metadata``
map (OpenAI's string-to-string shape) on the final chunk that says the answer was continued.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.core.stream_transcript import event_data
from proxy.core.validation import Endpoint

# OpenAI's default max_tokens for /v1/completions (vLLM's and SGLang's too).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def not_continuable(body: dict[str, Any], endpoint: Endpoint) -> str | None:
    """Why this request can never be continued mid-stream (None: it can)."""
    for key in ("n", "best_of"):
        if isinstance(body.get(key), int) and body[key] > 1:
            return "several_choices"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if any(body.get(k) is not None for k in _STRUCTURED):
        return "structured_output"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "structured_output"
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and not (len(prompt) == 1 and isinstance(prompt[0], str)):
            return "prompt_not_text"
        if not isinstance(prompt, (str, list)):
            return "prompt_not_text"
    return None


def _max_key(body: dict[str, Any], endpoint: Endpoint) -> str | None:
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens" if body.get("max_tokens") is not None else None


def remaining_tokens(body: dict[str, Any], endpoint: Endpoint, sent: int) -> int | None:
    """Tokens the continuation may still generate (None: no limit was set, chat's default)."""
    key = _max_key(body, endpoint)
    if key is not None:
        return int(body[key]) - sent
    if endpoint == "completions":
        return COMPLETIONS_DEFAULT_MAX_TOKENS - sent
    return None


def continuation_body(
    body: dict[str, Any], endpoint: Endpoint, text: str, sent: int
) -> dict[str, Any] | None:
    """The request that continues ``body`` after ``text`` (``sent`` tokens) reached the client.

    None when nothing is left to generate (the limit was reached as the stream broke).
    """
    left = remaining_tokens(body, endpoint, sent)
    if left is not None and left < 1:
        return None
    out = copy.deepcopy(body)
    key = _max_key(body, endpoint) or "max_tokens"
    if left is not None:
        out[key] = left
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - sent)
    if not text:
        return out
    if endpoint == "completions":
        prompt = out["prompt"]
        out["prompt"] = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
        return out
    messages = out["messages"]
    last = messages[-1]
    if (
        body.get("continue_final_message")
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    ):
        last["content"] += text
    else:
        messages.append({"role": "assistant", "content": text})
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


@dataclass(slots=True)
class Splice:
    """Rewrites a continuation's events into the stream the client already has."""

    endpoint: Endpoint
    identity: dict[str, Any]
    # Tokens the client had received before the current part began.
    earlier_tokens: int = 0
    backends: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)

    def metadata(self) -> dict[str, str]:
        """The final chunk's marker: strings only, as OpenAI's ``metadata`` maps are."""
        return {
            "kvroute_continuations": str(len(self.backends) - 1),
            "kvroute_backends": ",".join(self.backends),
            "kvroute_causes": ",".join(self.causes),
        }

    def rewrite(self, event: bytes) -> bytes | None:
        """One continuation event as the client's stream carries it (None: drop it)."""
        data = event_data(event)
        if data is None or data.strip() == b"[DONE]":
            return event
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(obj, dict) or "error" in obj or obj.get("object") == "error":
            return event
        if not self._rewrite_chunk(obj):
            return None
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _rewrite_chunk(self, obj: dict[str, Any]) -> bool:
        obj.update(self.identity)
        final = bool(obj.get("usage"))
        raw_choices = obj.get("choices")
        choices: list[Any] = raw_choices if isinstance(raw_choices, list) else []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if self.endpoint == "chat" and isinstance(delta, dict) and "role" in delta:
                del delta["role"]
                if not delta.get("content") and choice.get("finish_reason") is None:
                    # The second part's role opener: the client has had one already.
                    if len(choices) == 1 and not obj.get("usage"):
                        return False
            final = final or choice.get("finish_reason") is not None
        if isinstance(obj.get("usage"), dict):
            obj["usage"] = self._usage(obj["usage"])
        if final:
            raw_meta = obj.get("metadata")
            meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
            obj["metadata"] = {**meta, **self.metadata()}
        return True

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Both parts: the continuation re-read the earlier text as prompt; it was output."""
        out = dict(usage)
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        out["prompt_tokens"] = max(0, prompt - self.earlier_tokens)
        out["completion_tokens"] = completion + self.earlier_tokens
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out
