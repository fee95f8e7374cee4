"""KV-cache events: where a backend publishes them, and how the gateway follows them.

``backends[].kv_events`` (or ``discovery.kv_events``, applied to every discovered backend)
says where; ``routing.prefix.events`` how (staleness, tier weight, bounds). Documented in
docs/kv-events.md.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from proxy.config.base import _Strict

_ENDPOINT = r"^(tcp://[^\s]+:[0-9]{1,5}|ipc://[^\s]+)$"


class KvEventsEndpoint(_Strict):
    """Where one backend publishes (vLLM ``--kv-events-config`` ``endpoint``/``replay_endpoint``).

    Give the rank-0 endpoint (``tcp://host:5557``) or only the ``port`` (the host is the
    backend URL's, as discovery needs). Data-parallel rank r publishes on port + r.
    """

    endpoint: str | None = Field(default=None, pattern=_ENDPOINT)
    port: int | None = Field(default=None, ge=1, le=65535)
    replay_endpoint: str | None = Field(default=None, pattern=_ENDPOINT)
    replay_port: int | None = Field(default=None, ge=1, le=65535)
    topic: str = Field(default="", max_length=256)
    ranks: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="data-parallel ranks publishing; none: the engines the scrape reports",
    )

    @model_validator(mode="after")
    def _one_address_each(self) -> KvEventsEndpoint:
        if (self.endpoint is None) == (self.port is None):
            raise ValueError("kv_events needs exactly one of endpoint or port")
        if self.replay_endpoint is not None and self.replay_port is not None:
            raise ValueError("kv_events takes replay_endpoint or replay_port, not both")
        return self

    def resolve(self, host: str) -> tuple[str, str | None]:
        """(rank-0 endpoint, rank-0 replay endpoint or None) for a backend on ``host``."""
        shown = f"[{host}]" if ":" in host else host
        main = self.endpoint or f"tcp://{shown}:{self.port}"
        replay = self.replay_endpoint
        if replay is None and self.replay_port is not None:
            replay = f"tcp://{shown}:{self.replay_port}"
        return main, replay


class KvEventsSettings(_Strict):
    """How events are followed and weighed (``routing.prefix.events``)."""

    enabled: bool = Field(default=True, description="false: ignore every kv_events endpoint")
    stale_after_s: float = Field(
        default=10.0,
        gt=0,
        description="no event this long after a request was placed there: back to the approximate index",
    )
    pending_s: float = Field(
        default=5.0,
        ge=0,
        description="a placement counts as cached there this long before its events arrive",
    )
    offloaded_weight: float = Field(
        default=0.5, ge=0.0, le=1.0, description="a block in an offload tier counts this much"
    )
    max_blocks_per_engine: int = Field(
        default=500_000, gt=0, description="bound of the exact index per engine (oldest first)"
    )
    replay_timeout_s: float = Field(
        default=2.0, gt=0, description="a replay answer slower than this counts as not covered"
    )
    reconcile_s: float = Field(
        default=1.0, gt=0, description="how often the backend list and engine counts are re-read"
    )


def for_rank(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel ``rank`` publishes on: port + rank (vLLM's own offset)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://") or endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


class ChatRender(_Strict):
    """How the servers render a chat for their prefix cache, so hashes match their blocks.

    The gateway's default rendering (role markers, then text) is its own: fine for the
    approximate index, which only compares the gateway's requests with each other, but a
    server's KV-cache events carry the token ids of *its* rendering. With this set, chat
    prompts are hashed as ``begin`` + ``message`` per message + ``generation``, each piece
    tokenized on its own (as the simulated engine does; a real server tokenizes the whole
    string, which matches wherever its template puts special tokens or newlines between
    messages). ``{role}`` and ``{content}`` are filled in.
    """

    begin: str = ""
    message: str = Field(default="<|{role}|>\n{content}\n")
    generation: str = "<|assistant|>\n"
    models: tuple[str, ...] = Field(
        default=(), description="the models rendered so; empty: every model"
    )

    @model_validator(mode="after")
    def _placeholders(self) -> ChatRender:
        if "{content}" not in self.message:
            raise ValueError("chat_render.message must contain {content}")
        try:
            self.message.format(role="user", content="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"chat_render.message: only {{role}} and {{content}} may be used ({e})"
            ) from None
        return self

    def applies_to(self, model: str) -> bool:
        return not self.models or model in self.models
