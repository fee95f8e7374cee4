"""The KV-event feeds of every backend that publishes them, and what routing reads from them.

One ``RankFeed`` (``proxy.backends.kv_feed``) per backend and data-parallel rank, each
filling its own ``EngineIndex`` (``proxy.core.exact_prefix``). A reconcile loop re-reads the
configured backends (reload, discovery) and the engines each one reports, and starts, stops
or re-points feeds to match: an endpoint that comes and goes, or a backend that appears,
is followed without a gateway restart. A backend whose reported start time changes (the
server restarted) has its indexes dropped, as its cache is empty.

Routing asks ``cached(backend, hashes, now)``: the tokens the best rank holds of a prompt,
or None when the backend's events are not live, and then the approximate index answers
(``proxy.gateway.affinity``). Live means every rank's feed got through (a message or a
replay), and no request placed there has gone unanswered by events for ``stale_after_s``:
vLLM publishes only when its cache changes, so silence alone is no sign of a dead feed,
but a placed prompt stores blocks, and those events must come.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import zmq.asyncio

from proxy.backends.kv_feed import RETRY_S, RankFeed
from proxy.config import Config
from proxy.config.kv_events import KvEventsSettings, for_rank
from proxy.core.exact_prefix import EngineIndex, cached_tokens
from proxy.core.fleet import FleetSnapshot
from proxy.tasks import PeriodicTask

Source = Literal["events", "approximate"]


@dataclass(frozen=True, slots=True)
class FeedSpec:
    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(slots=True)
class _Running:
    spec: FeedSpec
    feed: RankFeed
    task: PeriodicTask


@dataclass(slots=True)
class _Backend:
    ranks: dict[int, _Running] = field(default_factory=dict)
    started_at: float | None = None
    #: The first placement no event has answered yet (0: none pending).
    unanswered_since: float = 0.0
    answered_through: float = 0.0


class KvEventFeeds:
    """Every backend's feeds; ``start``/``stop`` from the app's lifespan."""

    def __init__(
        self,
        config: Callable[[], Config],
        snapshot: Callable[[], FleetSnapshot | None],
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._snapshot = snapshot
        self.clock = clock
        self._ctx = zmq.asyncio.Context()
        self._backends: dict[str, _Backend] = {}
        self._task = PeriodicTask(
            "kv-event-feeds", self._reconcile_round, lambda: self.settings.reconcile_s
        )

    @property
    def settings(self) -> KvEventsSettings:
        return self._config().routing.prefix.events

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        for name in list(self._backends):
            await self._drop_backend(name)
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------------ reads
    def source(self, backend: str, now: float) -> Source:
        return "events" if self._live(backend, now) else "approximate"

    def cached(self, backend: str, hashes: Sequence[int], now: float) -> int | None:
        """Tokens of the prompt the backend's best rank holds; None when events are not live."""
        if not self._live(backend, now):
            return None
        s = self.settings
        best = 0
        for r in self._backends[backend].ranks.values():
            got = r.feed.index.match(hashes)
            best = max(best, cached_tokens(got, r.feed.index.block_tokens, s.offloaded_weight))
        return best

    def held_tokens(self, backend: str) -> int:
        """Tokens the backend's engines hold cached, all ranks (for spreading new prefixes)."""
        b = self._backends.get(backend)
        if b is None:
            return 0
        return sum(r.feed.index.hashes() * r.feed.index.block_tokens for r in b.ranks.values())

    def placed(self, backend: str, hashes: Sequence[int], now: float) -> None:
        """A request went to ``backend``: events should follow (the staleness check).

        Only a prompt with blocks the engine lacks makes it store (and publish) anything: a
        fully cached one does not count, or an idle engine's repeats would look stale.
        """
        b = self._backends.get(backend)
        if b is None or b.unanswered_since or not hashes:
            return
        held = max((r.feed.index.match(hashes).any_blocks for r in b.ranks.values()), default=0)
        if held < len(hashes):
            b.unanswered_since = now

    def feeds(self) -> list[tuple[str, int, RankFeed]]:
        return [(n, rank, r.feed) for n, b in self._backends.items() for rank, r in b.ranks.items()]

    def _live(self, backend: str, now: float) -> bool:
        b = self._backends.get(backend)
        if b is None or not b.ranks:
            return False
        last = 0.0
        for r in b.ranks.values():
            if not r.feed.stats.synced:
                return False
            last = max(last, r.feed.stats.last_message_at)
        if b.unanswered_since and last >= b.unanswered_since:
            b.unanswered_since = 0.0
        return not b.unanswered_since or now - b.unanswered_since <= self.settings.stale_after_s

    # ------------------------------------------------------------- reconcile
    async def _reconcile_round(self) -> None:
        """Feeds to match the configured backends, their engine counts and start times."""
        cfg = self._config()
        wanted = self._wanted_specs(cfg)
        for name in [n for n in self._backends if n not in wanted]:
            await self._drop_backend(name)
        for name, specs in wanted.items():
            b = self._backends.setdefault(name, _Backend())
            for rank in [r for r in b.ranks if r not in specs or b.ranks[r].spec != specs[r]]:
                await b.ranks.pop(rank).task.stop()
            for rank, spec in specs.items():
                if rank not in b.ranks:
                    b.ranks[rank] = self._start_feed(name, rank, spec, cfg)

    def _wanted_specs(self, cfg: Config) -> dict[str, dict[int, FeedSpec]]:
        if not cfg.routing.prefix.events.enabled:
            return {}
        reports = self._reports()
        out: dict[str, dict[int, FeedSpec]] = {}
        for b in cfg.backends:
            if b.kv_events is None:
                continue
            started, engines = reports.get(b.name, (None, 1))
            self._note_start(b.name, started)
            main, replay = b.kv_events.resolve(b.url.host or "127.0.0.1")
            ranks = b.kv_events.ranks or engines
            out[b.name] = {
                r: FeedSpec(
                    for_rank(main, r),
                    for_rank(replay, r) if replay else None,
                    b.kv_events.topic,
                )
                for r in range(ranks)
            }
        return out

    def _reports(self) -> dict[str, tuple[float | None, int]]:
        snap = self._snapshot()
        if snap is None:
            return {}
        return {
            n.name: (n.report.started_at or None, max(1, n.report.engines))
            for n in snap.nodes
            if n.report is not None
        }

    def _note_start(self, name: str, started: float | None) -> None:
        b = self._backends.get(name)
        if b is None or started is None:
            return
        if b.started_at is not None and b.started_at != started:
            # The server restarted: its cache is empty whatever its feed said.
            for r in b.ranks.values():
                r.feed.index.clear()
        b.started_at = started

    def _start_feed(self, name: str, rank: int, spec: FeedSpec, cfg: Config) -> _Running:
        s = cfg.routing.prefix.events
        index = EngineIndex(cfg.routing.prefix.block_tokens, s.max_blocks_per_engine)
        feed = RankFeed(
            self._ctx,
            spec.endpoint,
            spec.replay_endpoint,
            spec.topic,
            index,
            self.clock,
            s.replay_timeout_s,
        )
        task = PeriodicTask(
            f"kv-events-{name}-{rank}",
            feed.session,
            RETRY_S,
            on_error=feed.on_error,
            stop_timeout_s=2.0,
        )
        task.start()
        return _Running(spec, feed, task)

    async def _drop_backend(self, name: str) -> None:
        b = self._backends.pop(name, None)
        if b is None:
            return
        for r in b.ranks.values():
            await r.task.stop()
