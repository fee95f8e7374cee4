"""A parsed request -> its KV demand: prompt tokens plus the output it may still write.

Output per sequence is ``max_completion_tokens`` / ``max_tokens`` when given, else the
model's ``default_max_tokens``: a number, or ``server`` for the server's own rule (vLLM:
chat ``max_model_len - prompt``, completions 16). A request runs ``n`` (or ``best_of``)
sequences per prompt that share the prompt's KV and each hold their own output, and a
completions request with several prompts runs each as its own sequence, so::

    demand = sum over prompts p of (p + sequences * output(p))

Pure: no asyncio (``proxy.gateway.sizing`` runs big requests in a worker thread).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from proxy.core import chunked_counter
from proxy.core.prefix_prompt import PiecesCache
from proxy.core.tokenizer import Counter, TokenCache, load_counter
from proxy.core.tokens import PromptCounter, SizingRules, work_chars
from proxy.core.validation import ParsedRequest

if TYPE_CHECKING:
    from proxy.config import Config

#: vLLM's (and OpenAI's legacy) completions default for ``max_tokens``.
SERVER_COMPLETIONS_DEFAULT = 16


@dataclass(frozen=True, slots=True)
class Demand:
    prompt_tokens: int
    max_new_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


@dataclass(frozen=True, slots=True)
class ModelSizing:
    """How one model's requests are sized (built from ``sizing`` + ``models.<name>``)."""

    counter: Counter
    rules: SizingRules = field(default_factory=SizingRules)
    default_max_tokens: int | Literal["server"] = 256
    #: What ``server`` falls back to for chat while the backend's max_model_len is unknown.
    fallback_max_tokens: int = 256
    max_model_len: int | None = None


def output_tokens(
    parsed: ParsedRequest, model: ModelSizing, prompt: int, max_model_len: int | None = None
) -> int:
    """Output one sequence may write: as given, else the model's default rule."""
    if parsed.max_tokens is not None:
        return parsed.max_tokens
    if model.default_max_tokens != "server":
        return model.default_max_tokens
    if parsed.endpoint == "completions":
        return SERVER_COMPLETIONS_DEFAULT
    limit = max_model_len if max_model_len is not None else model.max_model_len
    if limit is None:
        return model.fallback_max_tokens
    return max(0, limit - prompt)


def demand_of(
    parsed: ParsedRequest, model: ModelSizing, prompts: list[int], max_model_len: int | None = None
) -> Demand:
    outs = [output_tokens(parsed, model, p, max_model_len) * parsed.sequences for p in prompts]
    return Demand(sum(prompts), sum(outs))


class Sizer:
    """Per-model counters and rules plus the token-count cache they share."""

    def __init__(
        self,
        default: ModelSizing,
        models: Mapping[str, ModelSizing] | None = None,
        cache: TokenCache | None = None,
        pieces: PiecesCache | None = None,
    ) -> None:
        self.default = default
        self.models = dict(models or {})
        self.cache = cache if cache is not None else TokenCache()
        #: Pieces of the texts counted (prefix affinity on): the prefix hashes reuse them.
        self.pieces = pieces

    def model(self, name: str) -> ModelSizing:
        return self.models.get(name, self.default)

    def work_chars(self, parsed: ParsedRequest) -> int:
        return work_chars(parsed.body, self.model(parsed.model).rules)

    def prompts(self, parsed: ParsedRequest) -> list[int]:
        """Prompt tokens of each sequence group (one for chat, one per completions prompt)."""
        m = self.model(parsed.model)
        pc = PromptCounter(m.counter, m.rules, self.cache, self.pieces)
        return [pc.chat(parsed.body)] if parsed.endpoint == "chat" else pc.prompts(parsed.body)

    def size(self, parsed: ParsedRequest, max_model_len: int | None = None) -> Demand:
        """The request's demand; ``max_model_len`` is the backend's, when an adapter knows it."""
        return demand_of(parsed, self.model(parsed.model), self.prompts(parsed), max_model_len)

    @classmethod
    def from_config(cls, cfg: Config) -> Sizer:
        """Load every configured tokenizer (slow: call off the event loop, once)."""
        s, r = cfg.sizing, cfg.routing
        counters: dict[tuple[str, str | None], Counter] = {}

        def build(enc: str, path: str | None, **over: int | str | None) -> ModelSizing:
            if (enc, path) not in counters:
                try:
                    counters[enc, path] = chunked_counter.chunked(load_counter(enc, path))
                except Exception as exc:
                    # tokenizers/tiktoken raise their own types; say which setting failed.
                    what = f"tokenizer_file {path!r}" if path else f"tokenizer {enc!r}"
                    raise ValueError(f"sizing: cannot load {what}: {exc}") from exc
            rules = SizingRules(
                tokens_per_message=_pick(over.get("tokens_per_message"), r.chat_tokens_per_message),
                reply_priming=_pick(over.get("reply_priming"), r.chat_tokens_reply_priming),
                tokens_per_name=_pick(over.get("tokens_per_name"), s.tokens_per_name),
                tokens_per_tool=_pick(over.get("tokens_per_tool"), s.tokens_per_tool),
                tokens_per_tool_call=s.tokens_per_tool_call,
                image_part_tokens=_pick(over.get("image_part_tokens"), s.image_part_tokens),
                audio_part_tokens=_pick(over.get("audio_part_tokens"), s.audio_part_tokens),
                video_part_tokens=_pick(over.get("video_part_tokens"), s.video_part_tokens),
                file_part_tokens=s.file_part_tokens,
                prompt_embeds_bytes_per_token=_pick(
                    over.get("prompt_embeds_bytes_per_token"), s.prompt_embeds_bytes_per_token
                ),
                max_field_chars=s.max_field_chars,
                cache_min_chars=s.cache_min_chars,
            )
            default = over.get("default_max_tokens") or s.default_max_tokens or r.default_max_tokens
            mml = over.get("max_model_len")
            return ModelSizing(
                counters[enc, path],
                rules,
                default_max_tokens="server" if default == "server" else int(default),
                fallback_max_tokens=r.default_max_tokens,
                max_model_len=int(mml) if mml is not None else None,
            )

        chunked_counter.configure(s.chunk_cache_mb << 20)
        models = {
            name: build(
                m.tokenizer or s.tokenizer,
                str(m.tokenizer_file) if m.tokenizer_file is not None else None,
                **m.model_dump(exclude={"tokenizer", "tokenizer_file"}),
            )
            for name, m in cfg.models.items()
        }
        default = build(s.tokenizer, str(s.tokenizer_file) if s.tokenizer_file else None)
        p = r.prefix
        pieces = PiecesCache() if p.enabled and p.max_prompt_tokens > 0 else None
        return cls(default, models, TokenCache(s.cache_entries), pieces)


def _pick(value: int | str | None, fallback: int) -> int:
    return fallback if value is None else int(value)
