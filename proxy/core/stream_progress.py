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
    """Characters per token per model: the characters over the tokens of what was observed,
    recent answers weighing more (the sums keep ``1 - weight`` of themselves per
    ``horizon_tokens`` tokens observed).

    A ratio of sums, not an average of per-answer ratios: a one-token answer (" of": 3
    characters) says little about the ratio, and as one sample of an average it moved the
    estimate as much as a 1,500-token stream. Measured: the one-token answers of two-step
    requests' prefill step pulled the learned 4.27 down to ~4.0, the decode flights' written
    tokens read high, their remaining growth low, and a decode server took a document it
    then preempted for (docs/benchmarks.md section 10).
    """

    weight: float = 0.2
    horizon_tokens: int = 1_000
    _sums: dict[str, tuple[float, float]] = field(default_factory=dict)

    def observe(self, model: str, chars: int, tokens: int) -> None:
        if tokens <= 0 or chars <= 0:
            return
        old = self._sums.get(model)
        if old is None:
            self._sums[model] = (float(chars), float(tokens))
            return
        keep = (1.0 - self.weight) ** (tokens / self.horizon_tokens)
        self._sums[model] = (old[0] * keep + chars, old[1] * keep + tokens)

    def get(self, model: str) -> float:
        sums = self._sums.get(model)
        return DEFAULT_CHARS_PER_TOKEN if sums is None else sums[0] / sums[1]
