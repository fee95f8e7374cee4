"""Honest token counts: learn how far the gateway's prompt count is from the server's.

The gateway sizes every request with a tokenizer it can run offline (cl100k by default). A
Llama, Qwen or Mistral model behind ``kind: vllm`` counts the same text 10-30% apart, and
nothing said so: the 400 "has N input tokens" and every fit decision used the wrong count.
Every answer carries the server's own count (``usage.prompt_tokens``, in a non-streamed body
and in a stream's final usage chunk), so the gateway compares, per model:

* the ratio is token-weighted (server tokens over gateway tokens, summed), so long prompts,
  the ones whose size decides routing, weigh most and a chat template's fixed few tokens on
  a short prompt do not swing it; older samples decay (``half_life_samples``);
* past ``tolerance`` (a few percent) after ``min_samples`` answers, the model is mismatched:
  the caller warns once, shows it (``/fleet``, a gauge) and, unless a tokenizer is configured
  for that model, multiplies its prompt counts by the learned ratio.

Pure: no I/O, no clock. ``prompt_tokens_in`` reads the count from answer bytes without
parsing the whole JSON body (the usage object sits at its end).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.03
DEFAULT_MIN_SAMPLES = 5
DEFAULT_HALF_LIFE_SAMPLES = 200
# A prompt this small is mostly template overhead: its ratio says little about the tokenizer.
MIN_PROMPT_TOKENS = 16
# Ratios outside this range are not a tokenizer difference (a multimodal prompt, a bug).
PLAUSIBLE = (0.25, 4.0)

_KEY = b'"prompt_tokens"'


@dataclass(slots=True)
class ModelCounts:
    """One model's decayed sums: tokens the gateway counted, tokens the server counted."""

    ours: float = 0.0
    theirs: float = 0.0
    samples: int = 0
    warned: bool = False

    @property
    def ratio(self) -> float:
        return self.theirs / self.ours if self.ours > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A model whose server counts ``ratio`` times the gateway's tokens (said once)."""

    model: str
    ratio: float
    samples: int
    corrected: bool


class TokenCalibration:
    """Per-model comparison of the gateway's prompt counts with the servers' ``usage``."""

    def __init__(
        self,
        configured: frozenset[str] = frozenset(),
        all_configured: bool = False,
        tolerance: float = DEFAULT_TOLERANCE,
        min_samples: int = DEFAULT_MIN_SAMPLES,
        half_life_samples: int = DEFAULT_HALF_LIFE_SAMPLES,
    ) -> None:
        # Models with their own tokenizer configured: compared and shown, never corrected.
        self.configured = configured
        # A tokenizer configured for every model (``sizing.tokenizer_file``/``tokenizer``).
        self.all_configured = all_configured
        self.tolerance = tolerance
        self.min_samples = min_samples
        self._keep = 0.5 ** (1.0 / half_life_samples)
        self._models: dict[str, ModelCounts] = {}

    def observe(self, model: str, ours: int, theirs: int) -> Mismatch | None:
        """Add one answer; returns the mismatch the first time the model crosses tolerance."""
        if ours < MIN_PROMPT_TOKENS or theirs <= 0:
            return None
        if not PLAUSIBLE[0] <= theirs / ours <= PLAUSIBLE[1]:
            return None
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelCounts()
        m.ours = m.ours * self._keep + ours
        m.theirs = m.theirs * self._keep + theirs
        m.samples += 1
        if m.warned or not self._off(m):
            return None
        m.warned = True
        return Mismatch(model, m.ratio, m.samples, not self.has_tokenizer(model))

    def has_tokenizer(self, model: str) -> bool:
        return self.all_configured or model in self.configured

    def _off(self, m: ModelCounts) -> bool:
        return m.samples >= self.min_samples and abs(m.ratio - 1.0) > self.tolerance

    def ratio(self, model: str) -> float | None:
        """The correction for ``model``'s counts; None when none applies."""
        m = self._models.get(model)
        if m is None or self.has_tokenizer(model) or not self._off(m):
            return None
        return m.ratio

    def correct(self, model: str, prompt_tokens: int) -> int:
        """``prompt_tokens`` as the server would count them, as far as learned."""
        r = self.ratio(model)
        return prompt_tokens if r is None else max(1, round(prompt_tokens * r))

    def ratios(self) -> dict[str, tuple[float, bool]]:
        """Per model: (server-to-gateway ratio, whether it corrects counts now)."""
        return {name: (m.ratio, self.ratio(name) is not None) for name, m in self._models.items()}

    def view(self) -> dict[str, dict[str, object]]:
        """Per model, for ``/fleet``: the ratio, the samples, and whether it is corrected."""
        return {
            name: {
                "server_to_gateway_ratio": round(m.ratio, 4),
                "samples": m.samples,
                "mismatched": self._off(m),
                "corrected": self.ratio(name) is not None,
                "tokenizer_configured": self.has_tokenizer(name),
            }
            for name, m in sorted(self._models.items())
        }


def prompt_tokens_in(data: bytes) -> int | None:
    """``usage.prompt_tokens`` from a JSON answer or SSE bytes; None when absent.

    Searched from the end (usage comes last). A quote not preceded by a backslash is a key:
    the same text inside a generated string would have its quotes escaped.
    """
    at = data.rfind(_KEY)
    while at > 0 and data[at - 1] == 0x5C:  # backslash: inside a string
        at = data.rfind(_KEY, 0, at)
    if at < 0:
        return None
    i = at + len(_KEY)
    n = len(data)
    while i < n and data[i] in b" \t\r\n:":
        i += 1
    start = i
    while i < n and 0x30 <= data[i] <= 0x39:
        i += 1
    return int(data[start:i]) if i > start else None
