"""The gateway's side of prefix and session affinity: hash at intake, look up at placement, record.

* Intake (``key_of``): the prompt's token ids (the model's tokenizer, repeated messages from
  a cache) hashed in chained blocks (``proxy.core.prefix``). Sizing computes them from the
  same encode as the count, in the same worker-thread hop (``proxy.gateway.sizing``); they
  are computed here only for a request sized otherwise. The session key is the ``x-session-id`` header (configurable)
  or the OpenAI ``user`` field.
* Placement (``route_request``): each node's expected saving from the index, the session's
  last node, into the ``RouteRequest`` the policy ranks (``proxy.routing.affinity``), and
  the (possibly discounted) demand to reserve on the chosen node (``demand_on``).
* Record (``placed``): the chosen node holds this prompt's blocks afterwards.

Each replica keeps its own index and looks only there while routing. With a Redis store and
``routing.prefix.share`` (the default), replicas also share placements: ``placed`` queues
each one for ``proxy.state.prefix_share``, which sends them and feeds the other replicas'
into ``learn`` in the background (one stream; nothing added to a request's path). Measured
with two replicas behind round robin: 63.6% hit rate shared vs 53.8% each on its own. The
index stays a hint: a wrong guess costs a prefill, never a failure (fit is checked in the
shared store).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from starlette.requests import Request

from proxy.config import Config, PrefixConfig
from proxy.core.fleet import FleetSnapshot, NodeView
from proxy.core.prefix import PrefixIndex, PrefixIndexConfig
from proxy.core.prefix_prompt import PiecesCache, text_pieces
from proxy.core.prefix_render import rendered_hashes
from proxy.core.validation import ParsedRequest
from proxy.gateway.sizing import hash_spec, prefix_hashes, sizer_for, take_hashes
from proxy.routing.affinity import AffinitySettings, demand_on, utilisation
from proxy.routing.expected_ttft import PrefillBacklog, reported_wait_s, slack_s
from proxy.routing.node_cost import NodeCost
from proxy.routing.policy import RouteRequest
from proxy.routing.queueing import DEFAULT_PREFILL_TOKENS_PER_S, Rates, is_queueing
from proxy.state.prefix_share import PrefixShare
from proxy.upstream.client import header

#: Above this many characters of prompt, ids and hashes are computed in a worker thread.
_THREAD_ABOVE_CHARS = 16_384
#: From this many blocks (8k tokens) a placement is written to the index on the loop's next turn.
_RECORD_LATER_BLOCKS = 512
#: A node this full (for new work) is evicting: the index forgets it sooner.
_EVICTING_UTILISATION = 0.95


def affinity_settings(p: PrefixConfig) -> AffinitySettings:
    """The policy's affinity weights from ``routing.prefix``."""
    return AffinitySettings(
        enabled=p.enabled,
        min_saving_tokens=p.min_saving_tokens,
        load_weight=p.load_weight,
        max_utilisation=p.max_utilisation,
        session_tokens=p.session_tokens,
        discount_paged=p.discount_paged,
        spread_new=p.spread_new,
    )


class ExactSource(Protocol):
    """What an engine says it holds (``proxy.backends.kv_events``), where it says so."""

    def cached(self, backend: str, hashes: Sequence[int], now: float) -> int | None: ...

    def held_tokens(self, backend: str) -> int: ...

    def placed(self, backend: str, hashes: Sequence[int], now: float) -> None: ...


@dataclass(slots=True)
class Placement:
    """Where a request whose block hashes come later went (``proxy.gateway.bound_route``)."""

    backend: str = ""


@dataclass(frozen=True, slots=True)
class AffinityKey:
    """What a request brings to affinity: its prompt's block hashes and its session."""

    hashes: tuple[int, ...] = ()
    session: str | None = None
    # Set for a request routed before its hashes were known: ``placed`` notes the backend.
    later: Placement | None = None
    # Filled at placement: each node's expected-TTFT terms, so that the node chosen learns
    # the prefill this request adds to its backlog (``Affinity.placed``).
    costs: dict[str, NodeCost] = field(default_factory=dict, compare=False)


class Affinity:
    """The prefix index and the session map of this replica."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg.routing.prefix
        c = self.cfg
        self.index = PrefixIndex(
            PrefixIndexConfig(c.block_tokens, c.ttl_s, c.pressure_ttl_s, c.max_blocks_per_node)
        )
        self.pieces_cache = PiecesCache()
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._full_cfg = cfg
        self._session_header = self.cfg.session_header.lower()
        # Set by the app when replicas share placements through Redis (routing.prefix.share).
        self.share: PrefixShare | None = None
        # Set by the app when backends publish KV-cache events (docs/kv-events.md): their
        # exact index answers while live, the approximate one otherwise.
        self.exact: ExactSource | None = None
        self._next_expiry = 0.0
        # Each node's last reported start time: a restarted server's cache is empty.
        self._started: dict[str, float] = {}
        # Prefill this gateway queued on each node (``proxy.routing.expected_ttft``), and
        # each node's prefill rate: configured here, learned ones set by the gateway.
        self.backlog = PrefillBacklog()
        configured = {
            b.name: Rates(b.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S)
            for b in cfg.backends
        }
        self.rates: Callable[[FleetSnapshot], Mapping[str, Rates]] = lambda _snap: configured

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # ------------------------------------------------------------------ intake
    async def key_of(self, request: Request, parsed: ParsedRequest) -> AffinityKey | None:
        """The request's block hashes and session; None when affinity is off."""
        if not self.cfg.enabled:
            return None
        session = self._session_of(request, parsed)
        if self.cfg.max_prompt_tokens <= 0:
            return AffinityKey((), session)
        spec = hash_spec(sizer_for(self._full_cfg), parsed, self.cfg)
        if spec is None:
            return AffinityKey((), session)
        hashes = take_hashes(parsed, spec)
        render = self.cfg.chat_render
        if render is not None and parsed.endpoint == "chat" and render.applies_to(parsed.model):
            # Hashed the servers' way, so that their KV-cache events match (docs/kv-events.md).
            if sum(len(m) for m in _texts(parsed)) > _THREAD_ABOVE_CHARS:
                return AffinityKey(await asyncio.to_thread(self.rendered_of, parsed), session)
            return AffinityKey(self.rendered_of(parsed), session)
        if hashes is None:
            # Sized with another config (a reload in between): hash here.
            chars = sum(len(m) for m in _texts(parsed))
            if chars > _THREAD_ABOVE_CHARS:
                hashes = await asyncio.to_thread(self.hashes_of, parsed)
            else:
                hashes = self.hashes_of(parsed)
        return AffinityKey(hashes, session)

    def session_key(self, request: Request, parsed: ParsedRequest) -> AffinityKey | None:
        """The session alone (hashes come later: ``proxy.gateway.bound_route``); None when off."""
        if not self.cfg.enabled:
            return None
        return AffinityKey((), self._session_of(request, parsed), Placement())

    def hashes_of(self, parsed: ParsedRequest) -> tuple[int, ...]:
        """The prompt's block hashes, from the sizer's pieces cache where sizing filled it."""
        sizer = sizer_for(self._full_cfg)
        spec = hash_spec(sizer, parsed, self.cfg)
        if spec is None:
            return ()
        # The sizer keeps no pieces when its config had prefix affinity off: this one's cache.
        return prefix_hashes(sizer, parsed, spec, sizer.pieces or self.pieces_cache)

    def rendered_of(self, parsed: ParsedRequest) -> tuple[int, ...]:
        """The chat's block hashes in the servers' rendering (``routing.prefix.chat_render``)."""
        sizer = sizer_for(self._full_cfg)
        counter = sizer.model(parsed.model).counter
        encode = text_pieces(counter)
        messages = parsed.body.get("messages")
        render = self.cfg.chat_render
        if encode is None or render is None or not isinstance(messages, list):
            return ()
        c = self.cfg
        cache = sizer.pieces or self.pieces_cache
        return rendered_hashes(
            messages, render, counter.id, encode, c.max_prompt_tokens, c.block_tokens, cache
        )

    def _session_of(self, request: Request, parsed: ParsedRequest) -> str | None:
        key = header(request.headers, self._session_header)
        if not key and self.cfg.session_from_user:
            user = parsed.body.get("user")
            key = user if isinstance(user, str) else None
        return f"{parsed.model[:200]}|{key[:200]}" if key else None

    # --------------------------------------------------------------- placement
    def route_request(
        self, key: AffinityKey | None, base: RouteRequest, view: FleetSnapshot, now: float
    ) -> RouteRequest:
        """``base`` with each node's expected saving and the session's last node filled in."""
        if key is None or not self.cfg.enabled:
            return base
        if not key.hashes and key.session is None:
            # Nothing to match or follow (a prompt shorter than one block, no session): the
            # index's upkeep waits for a request that reads it.
            return base
        self._observe(view, now)
        cached: dict[str, int] = {}
        exact: dict[str, int] = {}
        if key.hashes:
            for n in view.nodes:
                tokens = self._cached_on(n.name, key.hashes, now, exact)
                if tokens:
                    cached[n.name] = tokens
        indexed = None
        if (
            self.cfg.spread_new
            and len(key.hashes) * self.cfg.block_tokens >= self.cfg.min_saving_tokens
        ):
            indexed = {n.name: self._held_on(n.name, exact) for n in view.nodes}
        session_node = self._session_node(key.session, now)
        ttft, slack = (
            self._ttft_costs(key, cached, view, now) if indexed is not None else (None, 0.0)
        )
        # Field by field, not ``dataclasses.replace`` (per request; replace inspects the fields).
        return RouteRequest(
            base.demand,
            base.cls,
            base.exclude,
            cached,
            session_node,
            indexed,
            ttft,
            slack,
            base.blind,
        )

    def _ttft_costs(
        self, key: AffinityKey, cached: Mapping[str, int], view: FleetSnapshot, now: float
    ) -> tuple[dict[str, NodeCost] | None, float]:
        """Each queueing node's expected-TTFT terms for this prompt, and the slack in seconds.

        The backlog is the larger of what this gateway queued there (its virtual clock) and
        what the node's own report shows waiting (other clients' work included).
        """
        key.costs.clear()
        if not self.cfg.ttft_aware:
            return None, 0.0
        rates = self.rates(view)
        prompt = len(key.hashes) * self.cfg.block_tokens
        for n in view.nodes:
            if not is_queueing(n) or n.report is None:
                continue
            rate = rates.get(n.name, Rates())
            per_s = rate.prefill_tokens_per_s * max(1, n.report.engines)
            ours = self.backlog.wait_s(n.name, now, n.overlay.inflight, per_s)
            backlog = max(ours, reported_wait_s(n, per_s))
            uncached = max(0, prompt - cached.get(n.name, 0))
            key.costs[n.name] = NodeCost(backlog, uncached, per_s)
        return key.costs, slack_s(prompt, key.costs, self.cfg.ttft_slack)

    def _cached_on(
        self, node: str, hashes: Sequence[int], now: float, exact: dict[str, int]
    ) -> int:
        """Tokens of the prompt ``node`` holds: its own events' word while live, else the guess."""
        if self.exact is not None:
            told = self.exact.cached(node, hashes, now)
            if told is not None:
                # What this gateway placed there moments ago is being computed: the engine
                # publishes its blocks only once it admits the request.
                pending = self.index.match(node, hashes, now, self.cfg.events.pending_s)
                told = max(told, pending * self.cfg.block_tokens)
                exact[node] = told
                return told
        return self.index.match(node, hashes, now) * self.cfg.block_tokens

    def _held_on(self, node: str, exact: dict[str, int]) -> int:
        """Tokens ``node`` holds cached, by the same source ``_cached_on`` used."""
        if self.exact is not None and node in exact:
            return self.exact.held_tokens(node)
        return self.index.size(node) * self.cfg.block_tokens

    def demand_on(self, req: RouteRequest, view: FleetSnapshot, name: str) -> int:
        """What to reserve on ``name``: the demand, less its cached prefix where it is reused."""
        if not req.cached:
            return req.demand
        for n in view.nodes:
            if n.name == name:
                return demand_on(n, req.demand, req.cached, self._settings())
        return req.demand

    def placed(self, key: AffinityKey | None, backend: str, now: float) -> None:
        """The request went to ``backend``: it holds the prompt's blocks, the session follows."""
        if key is None:
            return
        if key.later is not None:
            key.later.backend = backend
        if not key.hashes and key.session is None:
            # Nothing to learn, nor to tell other replicas.
            return
        if len(key.hashes) >= _RECORD_LATER_BLOCKS and _loop() is not None:
            # A long prompt's blocks (~2 ms for 50k tokens) are written once the request has
            # gone upstream (the loop's next turn, while the backend works), not before.
            self.learn(backend, (), key.session, now)
            asyncio.get_running_loop().call_soon(self.index.record, backend, key.hashes, now)
        else:
            self.learn(backend, key.hashes, key.session, now)
        cost = key.costs.get(backend)
        if cost is not None:
            self.backlog.add(backend, cost.uncached_tokens, cost.tokens_per_s, now)
        if self.exact is not None and key.hashes:
            self.exact.placed(backend, key.hashes, now)
        if self.share is not None:
            # Other replicas learn it from the shared stream (proxy.state.prefix_share).
            self.share.publish(backend, key.hashes, key.session, now)

    def learn(
        self, backend: str, hashes: Sequence[int], session: str | None, placed_at: float
    ) -> None:
        """A placement, this replica's or (shared) another's: ``backend`` holds these blocks."""
        if hashes:
            self.index.record(backend, hashes, placed_at)
        if session is not None and self.cfg.max_sessions > 0:
            self._sessions[session] = (backend, placed_at)
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.cfg.max_sessions:
                self._sessions.popitem(last=False)

    # ------------------------------------------------------------------ upkeep
    def _session_node(self, session: str | None, now: float) -> str | None:
        if session is None:
            return None
        hit = self._sessions.get(session)
        if hit is None or now - hit[1] > self.cfg.session_ttl_s:
            return None
        return hit[0]

    def _observe(self, view: FleetSnapshot, now: float) -> None:
        for n in view.nodes:
            r = n.report
            if r is None:
                continue
            if self._started.setdefault(n.name, r.started_at) != r.started_at:
                self.index.forget(n.name)
                self.backlog.forget(n.name)
                self._started[n.name] = r.started_at
            self.index.observe(n.name, r.capacity_tokens, _evicting(n))
        if now >= self._next_expiry:
            # Age expiry sweeps at most once a second: matching checks ages anyway.
            self.index.expire(now)
            self._next_expiry = now + 1.0

    def _settings(self) -> AffinitySettings:
        return affinity_settings(self.cfg)


def _loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _evicting(n: NodeView) -> bool:
    """A node that queues, preempts or is nearly full reuses its free cached blocks soon."""
    return bool(n.overlay.pressure) or utilisation(n) > _EVICTING_UTILISATION


def _texts(parsed: ParsedRequest) -> list[str]:
    body = parsed.body
    out: list[str] = []
    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    p = body.get("prompt")
    if isinstance(p, str):
        out.append(p)
    elif isinstance(p, list) and p and isinstance(p[0], str):
        out.append(p[0])
    return out
