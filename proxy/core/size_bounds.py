"""Proven bounds on a request's demand without encoding its long texts: route now, count later.

A new 220 KB document costs 15-25 ms of CPU to encode exactly. When bounds on its count
already decide everything routing needs (its class, the length limit, which nodes fit), the
gateway may route on the upper bound and finish the exact count off the request's path
(``proxy.gateway.bound_route``). The bounds hold for the tokenizers the chunk cache cuts
(``proxy.core.chunked_counter``: cl100k, and Hugging Face byte-level BPEs with a known split
pattern, ``proxy.core.tokenizer.hf_cut_safe``), and only those are bounded here:

* **Upper: a text has at most as many tokens as UTF-8 bytes.** Every token of a byte-level
  BPE stands for at least one byte, and these counters add no special tokens of their own
  (tiktoken's ordinary encode, HF with ``add_special_tokens=False``).
* **Lower: at least one token, plus one per space between two ASCII letters.** Such a space
  always starts a new pre-tokenizer piece (the fact the chunk cuts rest on,
  ``proxy.core.chunk_cuts``), pieces are never merged, and each piece is at least one
  token. For English prose that is ~0.7 of the exact count (one per word), so a request
  whose lower bound is already long is long.

Every text of the request is bounded so (roles, names, tool definitions too: nothing is
encoded, so the bounds cost a length and one numpy pass per text), under the same rules as
the exact count, so the whole demand is bounded: every rule is a sum of non-negative terms,
and the output allowance never shrinks the total as the prompt grows (``max_model_len -
prompt`` makes the total the limit). A field past ``sizing.max_field_chars`` counts its
bytes in the exact count too. Property tests compare both bounds
with the exact count over random texts for tiktoken and HF (tests/core/test_size_bounds.py).

Pure: no I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.core.chunk_count import CHUNK_ABOVE_CHARS
from proxy.core.chunked_counter import ChunkedCounter
from proxy.core.demand import Demand, Sizer, demand_of
from proxy.core.tokens import PromptCounter, utf8_len
from proxy.core.validation import ParsedRequest

_SPACE, _CASE, _A, _LETTERS = np.uint8(0x20), np.uint8(0x20), np.uint8(ord("a")), np.uint8(26)


def piece_floor(text: str) -> int:
    """At least this many tokens: 1 for a non-empty text, plus its spaces between ASCII letters."""
    if not text:
        return 0
    data = text.encode("utf-8", "surrogatepass")
    if len(data) < 3:
        return 1
    b = np.frombuffer(data, dtype=np.uint8)
    mask = b[1:-1] == _SPACE
    mask &= ((b[:-2] | _CASE) - _A) < _LETTERS
    mask &= ((b[2:] | _CASE) - _A) < _LETTERS
    return 1 + int(np.count_nonzero(mask))


class _Bounding:
    """A counter standing in for a cut-safe one: each text's upper or lower bound, no encode."""

    def __init__(self, inner: ChunkedCounter, upper: bool) -> None:
        self.upper = upper
        self.id = inner.id + ("|upper" if upper else "|lower")

    def count(self, text: str) -> int:
        return utf8_len(text) if self.upper else piece_floor(text)


@dataclass(frozen=True, slots=True)
class DemandBounds:
    """``lower.total <= exact total <= upper.total``, and the same for prompt tokens."""

    lower: Demand
    upper: Demand


def demand_bounds(
    sizer: Sizer, parsed: ParsedRequest, max_model_len: int | None = None
) -> DemandBounds | None:
    """Both bounds of ``parsed``'s demand; None when its tokenizer is not one they hold for."""
    model = sizer.model(parsed.model)
    counter = model.counter
    if not isinstance(counter, ChunkedCounter):
        return None
    out: list[Demand] = []
    for upper in (False, True):
        pc = PromptCounter(_Bounding(counter, upper), model.rules, None)
        prompts = [pc.chat(parsed.body)] if parsed.endpoint == "chat" else pc.prompts(parsed.body)
        out.append(demand_of(parsed, model, prompts, max_model_len))
    return DemandBounds(out[0], out[1])


def prompt_texts(body: dict[str, Any]) -> Iterator[str]:
    """The prompt's texts in the order the prefix index hashes them (``proxy.core.prefix_prompt``)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if not isinstance(m, dict):
                continue
            yield f"<{m.get('role', '')}>"
            content = m.get("content")
            if isinstance(content, str):
                yield content
                continue
            for part in content if isinstance(content, list) else []:
                if isinstance(part, str):
                    yield part
                elif isinstance(part, dict):
                    text = part.get("text")
                    yield text if isinstance(text, str) else f"<{part.get('type')}>"
        return
    p = body.get("prompt")
    if isinstance(p, str):
        yield p
    elif isinstance(p, list) and p and isinstance(p[0], str):
        yield p[0]


def new_within(counter: ChunkedCounter, body: dict[str, Any], limit_bytes: int) -> bool:
    """The prompt's new text starts within its first ``limit_bytes`` UTF-8 bytes.

    Then no backend can hold more than that much of its prefix (bytes >= tokens), as far as
    this gateway has seen the text: the index's hashes are chained from the first token, so
    nothing after new text can match. Looked at: the texts before the first long one
    (counted as if known), then that text's first chunk (new or not). A text this gateway
    met whose chunks the cache has since dropped is what this cannot see: it costs a hit.
    """
    seen = 0
    for text in prompt_texts(body):
        if seen > limit_bytes:
            return False
        if len(text) < CHUNK_ABOVE_CHARS:
            seen += utf8_len(text)
            continue
        return counter.cache.first_chunk_new(counter.id, text)
    return False
