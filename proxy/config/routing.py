"""Routing and request sizing: thresholds, prefix affinity, per-model tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from proxy.config.base import PolicyName, _Strict
from proxy.config.kv_events import ChatRender, KvEventsSettings

# The error tree lives in proxy.errors; re-exported where callers have always found it.
from proxy.errors import ConfigError as ConfigError


class PrefixConfig(_Strict):
    """Prefix-cache and session affinity (``proxy.routing.affinity``, ``proxy.core.prefix``)."""

    enabled: bool = Field(default=True, description="false: route by fit and length only")
    block_tokens: int = Field(
        default=16, gt=0, description="tokens per hashed block (vLLM's default block size)"
    )
    max_prompt_tokens: int = Field(
        default=131_072, ge=0, description="only this many leading prompt tokens are hashed"
    )
    ttl_s: float = Field(
        default=600.0, gt=0, description="a block not used for this long is forgotten"
    )
    pressure_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="the same on a node that is queueing, preempting or >95% full",
    )
    max_blocks_per_node: int = Field(
        default=200_000,
        gt=0,
        description="bound of the index per node (LRU; also <= its KV capacity)",
    )
    min_saving_tokens: int = Field(
        default=512, ge=0, description="a smaller expected saving leaves the fit order alone"
    )
    load_weight: float = Field(
        default=1.0, ge=0.0, le=1.0, description="score = saving x (1 - load_weight x utilisation)"
    )
    max_utilisation: float = Field(
        default=0.9, gt=0.0, le=1.0, description="a node fuller than this never wins by affinity"
    )
    discount_paged: bool = Field(
        default=True,
        description="paged, queueing servers: the cached prefix lowers the demand checked and reserved",
    )
    spread_new: bool = Field(
        default=True,
        description="paged fleets: a new long prefix goes where it displaces the least cached content",
    )
    ttft_aware: bool = Field(
        default=False,
        description="queueing servers: a cached node whose prefill backlog costs more than "
        "recomputing the prompt elsewhere yields (docs/expected-ttft.md; off: measured to "
        "spill too often where the learned prefill rate reads low)",
    )
    ttft_slack: float = Field(
        default=0.25,
        ge=0.0,
        description="a node within this fraction of the prompt's full prefill time of the "
        "best expected TTFT keeps its affinity place",
    )
    session_header: str = Field(default="x-session-id", min_length=1)
    session_from_user: bool = Field(
        default=True, description="the OpenAI `user` field is a session key"
    )
    session_tokens: int = Field(
        default=1024, ge=0, description="the session's last node counts as this many cached tokens"
    )
    session_ttl_s: float = Field(default=1800.0, gt=0)
    max_sessions: int = Field(default=100_000, ge=0)
    share: bool = Field(
        default=True,
        description="with a Redis store: replicas share placements (a bounded Redis stream)",
    )
    share_poll_s: float = Field(
        default=0.1, gt=0, description="how often a replica sends and reads shared placements"
    )
    share_max_entries: int = Field(
        default=1_000, gt=0, description="bound of the shared stream (entries, oldest trimmed)"
    )
    share_max_blocks: int = Field(
        default=8_192,
        gt=0,
        description="leading block hashes shared per placement, and per stream entry",
    )
    events: KvEventsSettings = Field(default_factory=KvEventsSettings)
    chat_render: ChatRender | None = None


class RoutingConfig(_Strict):
    policy: PolicyName = "kvroute"
    long_threshold_tokens: int = Field(default=8_000, gt=0)
    default_max_tokens: int = Field(default=256, gt=0)
    max_tokens_limit: int = Field(
        default=1_000_000, gt=0, description="max_tokens above this is a 400"
    )
    safety_margin: float = Field(
        default=0.02, ge=0.0, lt=1.0, description="fraction of demand kept spare"
    )
    chat_tokens_per_message: int = Field(default=3, ge=0)
    chat_tokens_reply_priming: int = Field(default=3, ge=0)
    tokenize_in_thread_chars: int = Field(
        default=8_192, ge=0, description="prompts longer than this are tokenized off the event loop"
    )
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    unknown_model: Literal["reject", "pass_through"] = Field(
        default="reject",
        description="a model no backend lists: 404 model_not_found (as vLLM), or send it anyway",
    )
    spill_margin_s: float = Field(
        default=1.0,
        ge=0,
        description="a long request leaves the long pool when its expected wait exceeds a "
        "general node's by more than this (queueing backends)",
    )


class SizingConfig(_Strict):
    """How requests are sized for every model (``models.<name>`` overrides per model)."""

    tokenizer: str = Field(default="cl100k_base", description="tiktoken encoding name")
    tokenizer_file: Path | None = Field(
        default=None,
        description="a Hugging Face tokenizer.json, or a llama.cpp model's .gguf (its own "
        "vocabulary); offline; wins over tokenizer",
    )
    default_max_tokens: int | Literal["server"] | None = Field(
        default=None, description="output assumed without max_tokens; none: routing's"
    )
    tokens_per_name: int = Field(default=1, ge=0)
    tokens_per_tool: int = Field(default=3, ge=0)
    tokens_per_tool_call: int = Field(default=3, ge=0)
    image_part_tokens: int = Field(default=1024, ge=0)
    audio_part_tokens: int = Field(default=750, ge=0)
    video_part_tokens: int = Field(default=4096, ge=0)
    file_part_tokens: int = Field(default=1024, ge=0)
    prompt_embeds_bytes_per_token: int = Field(default=2048, gt=0)
    max_field_chars: int = Field(
        default=1_048_576, gt=0, description="a longer field counts its UTF-8 bytes, untokenized"
    )
    cache_entries: int = Field(default=16_384, ge=0)
    cache_min_chars: int = Field(default=256, ge=0)
    chunk_cache_mb: int = Field(
        default=64,
        ge=0,
        description="memory for long texts' chunks (their pieces, 8 bytes a token) reused "
        "wherever a chunk recurs, a quarter of it for joined tails (docs/big-prompts.md); 0: off",
    )
    route_on_bound: bool = Field(
        default=True,
        description="route a big new prompt on a proven upper bound of its tokens while the "
        "exact count finishes, where the bound cannot change the route; its reservation holds "
        "the bound (4-5x the prompt) until the count arrives, then shrinks to the exact "
        "demand (docs/big-prompts.md)",
    )
    threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="worker threads that size big requests (encodes at once); 2+ also splits "
        "one big text across two when the other is free",
    )

    @model_validator(mode="after")
    def _file_exists(self) -> SizingConfig:
        _check_tokenizer_file(self.tokenizer_file)
        if isinstance(self.default_max_tokens, int) and self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens must be at least 1 (got {self.default_max_tokens})"
            )
        return self


class ModelConfig(_Strict):
    """One model's sizing: its tokenizer, chat-template overhead and default output."""

    tokenizer: str | None = None
    tokenizer_file: Path | None = None
    tokens_per_message: int | None = Field(default=None, ge=0)
    reply_priming: int | None = Field(default=None, ge=0)
    tokens_per_name: int | None = Field(default=None, ge=0)
    tokens_per_tool: int | None = Field(default=None, ge=0)
    image_part_tokens: int | None = Field(default=None, ge=0)
    audio_part_tokens: int | None = Field(default=None, ge=0)
    video_part_tokens: int | None = Field(default=None, ge=0)
    prompt_embeds_bytes_per_token: int | None = Field(default=None, gt=0)
    default_max_tokens: int | Literal["server"] | None = None
    max_model_len: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _file_exists(self) -> ModelConfig:
        _check_tokenizer_file(self.tokenizer_file)
        if isinstance(self.default_max_tokens, int) and self.default_max_tokens < 1:
            raise ValueError(
                f"default_max_tokens must be at least 1 (got {self.default_max_tokens})"
            )
        return self


def _check_tokenizer_file(path: Path | None) -> None:
    if path is not None and not path.is_file():
        raise ValueError(f"tokenizer_file: no such file (got {str(path)!r})")
