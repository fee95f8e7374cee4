"""How many tokens a relayed OpenAI stream has carried so far, from its bytes alone.

The projection (``proxy.core.projection``) shrinks as requests write their output, and
learns output lengths from finished streams, but the gateway never tokenizes answers. An
SSE event carries one token or several (servers batch under load: the simulated engine at
speedup, vLLM's ``stream_interval``), so counting events undercounts. So each chunk is read
for its events and its text characters, and tokens are estimated as the larger of the
event count and characters / characters-per-token. The ratio is learned per model from
streams that end at ``max_tokens`` (``finish_reason: "length"``: the token count is known
exactly); 4 (English text in BPE vocabularies) until then.

Pure: bytes in, numbers out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DEFAULT_CHARS_PER_TOKEN = 4.0
_TEXT = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')
_LENGTH = b'"finish_reason":"length"'


@dataclass(slots=True)
class StreamCount:
    """One stream's events and text characters so far, and whether it hit ``max_tokens``."""

    events: int = 0
    chars: int = 0
    at_length: bool = False

    def add(self, chunk: bytes) -> None:
        self.events += max(0, chunk.count(b"data:") - chunk.count(b"[DONE]"))
        self.chars += sum(len(m) for m in _TEXT.findall(chunk))
        if _LENGTH in chunk:
            self.at_length = True

    def tokens(self, chars_per_token: float, max_tokens: int) -> int:
        """Tokens written so far (an estimate, exact at ``max_tokens``)."""
        if self.at_length:
            return max_tokens
        by_chars = int(self.chars / chars_per_token) if chars_per_token > 0 else 0
        return min(max_tokens, max(self.events, by_chars))


@dataclass
class CharsPerToken:
    """Characters per token per model, learned from streams that ended at ``max_tokens``."""

    weight: float = 0.2
    _by_model: dict[str, float] = field(default_factory=dict)

    def observe(self, model: str, chars: int, tokens: int) -> None:
        if tokens <= 0 or chars <= 0:
            return
        ratio = chars / tokens
        old = self._by_model.get(model)
        self._by_model[model] = ratio if old is None else old + self.weight * (ratio - old)

    def get(self, model: str) -> float:
        return self._by_model.get(model, DEFAULT_CHARS_PER_TOKEN)
