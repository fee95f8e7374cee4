"""Sharing the prefix index between gateway replicas: one bounded Redis stream of placements.

Each replica keeps its own index (``proxy.core.prefix``) and looks only there while routing:
no Redis call is added to a request's path. With ``routing.prefix.share: true`` (and a Redis
store) a replica also *publishes* each placement it makes (node, the prompt's block hashes,
the session) and *reads* the other replicas' placements into its own index, both in one
background loop every ``share_poll_s``:

* one ``XADD`` per round that has placements to send, all of them in one entry, onto
  ``<key_prefix>:prefix:placed`` (an entry holds at most ``share_max_blocks`` hashes; a
  busier round makes more entries), then one ``XREAD``: a few Redis commands per round
  whatever the request rate;
* the stream is bounded: ``MAXLEN ~ share_max_entries`` (Redis trims whole entries, the
  oldest first), a placement shares at most ``share_max_blocks`` leading hashes (8 bytes
  each, base64), and the key expires ``ttl_s`` after the last write (an idle fleet leaves
  nothing behind). Worst case in Redis: entries × ``share_max_blocks`` × ~11 bytes;
* a replica that starts (or comes back) reads what was placed in the last ``ttl_s``, as far
  as the stream still holds it, then follows the stream;
* an entry older than ``ttl_s`` on the store's clock is skipped: the server has probably
  evicted those blocks since.

Why a stream of placements rather than a shared key per block: a 30k-token prompt is ~1,900
blocks, and per-block keys with TTLs would be ~1,900 writes per request; here it is one
write, and reads are batched. The index stays a hint: a lost or late entry costs one
prefill, never a failure (fit is checked in the shared store).

Redis being away never fails a request: a failed round is logged and retried next round
(placements queued meanwhile are kept, up to ``_OUTBOX``, then the oldest dropped).
"""

from __future__ import annotations

import base64
import logging
import secrets
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from proxy.config import Config
from proxy.state.redis_connect import RedisClient, connect
from proxy.tasks import PeriodicTask

log = logging.getLogger("kvroute.prefix_share")

#: Entries read per XREAD (a round reads until it has caught up, at most this × 10).
_READ_BATCH = 100
#: Placements kept for sending while Redis is away (then the oldest are dropped).
_OUTBOX = 10_000


class Learner(Protocol):
    """What takes in another replica's placement (``proxy.gateway.affinity.Affinity``)."""

    def learn(
        self, node: str, hashes: Sequence[int], session: str | None, placed_at: float
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Placement:
    node: str
    hashes: tuple[int, ...]
    session: str | None
    placed_at: float


def encode_hashes(hashes: Sequence[int]) -> str:
    """Block hashes (unsigned 64-bit) as base64 text (the store's client decodes replies)."""
    try:
        raw = array("Q", hashes).tobytes()
    except OverflowError:
        return ""
    return base64.b64encode(raw).decode("ascii")


def decode_hashes(text: str) -> tuple[int, ...]:
    """The inverse of ``encode_hashes``; garbage (another version's entry) decodes to nothing."""
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return ()
    if len(raw) % 8:
        return ()
    out: array[int] = array("Q")
    out.frombytes(raw)
    return tuple(out)


class PrefixShare:
    """This replica's publisher and reader of the shared placement stream."""

    def __init__(
        self,
        client: RedisClient,
        cfg: Config,
        learner: Callable[[], Learner],
        clock: Callable[[], float],
    ) -> None:
        p = cfg.routing.prefix
        self.client = client
        self.key = f"{cfg.store.key_prefix}:prefix:placed"
        self.ttl_s = p.ttl_s
        self.max_entries = p.share_max_entries
        self.max_blocks = p.share_max_blocks
        self.replica = secrets.token_hex(6)
        self._learner = learner
        self._clock = clock
        self._outbox: deque[Placement] = deque(maxlen=_OUTBOX)
        self._last_id: str | None = None
        self.published = 0
        self.learned = 0
        self._failing = False
        self._task = PeriodicTask("prefix-share", self.round, p.share_poll_s, on_error=self._failed)

    @classmethod
    def from_config(
        cls, cfg: Config, learner: Callable[[], Learner], clock: Callable[[], float]
    ) -> PrefixShare | None:
        """The share when configured (``routing.prefix.share`` and a Redis store), else None."""
        p = cfg.routing.prefix
        s = cfg.store
        if not (p.enabled and p.share) or not (s.redis_url or s.sentinel is not None):
            return None
        return cls(connect(s, max_connections=2), cfg, learner, clock)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task.start()

    async def close(self) -> None:
        await self._task.stop()
        # What is still queued is a hint only: not worth delaying shutdown for.
        await self.client.close()

    # ------------------------------------------------------------------ publish
    def publish(self, node: str, hashes: Sequence[int], session: str | None, now: float) -> None:
        """Queue a placement for the next round (never waits; the oldest go when over the bound)."""
        self._outbox.append(Placement(node, tuple(hashes[: self.max_blocks]), session, now))

    async def round(self) -> None:
        """Send what was placed here since the last round, then read what others placed."""
        await self._send()
        await self._read()
        if self._failing:
            log.warning("prefix share: Redis answers again")
            self._failing = False

    def _failed(self, exc: Exception) -> None:
        # Once per outage, not every round: sharing is a hint, routing goes on without it.
        if not self._failing:
            log.warning("prefix share: Redis unavailable (%s); retrying every round", exc)
            self._failing = True

    async def _send(self) -> None:
        if not self._outbox:
            return
        batch = list(self._outbox)
        self._outbox.clear()
        try:
            await self._xadd(batch)
        except BaseException:
            # Back in front of what was placed meanwhile, the newest kept within the bound.
            kept = deque(batch + list(self._outbox), maxlen=self._outbox.maxlen)
            self._outbox = kept
            raise
        self.published += len(batch)

    async def _xadd(self, batch: list[Placement]) -> None:
        pipe = self.client.client.pipeline(transaction=False)
        for chunk in self._entries(batch):
            fields = {"r": self.replica, "p": orjson.dumps(chunk).decode()}
            pipe.xadd(self.key, fields, maxlen=self.max_entries, approximate=True)
        pipe.pexpire(self.key, int(self.ttl_s * 1000))
        await pipe.execute()

    def _entries(self, batch: list[Placement]) -> list[list[list[Any]]]:
        """The round's placements in entries of at most ``max_blocks`` hashes each."""
        entries: list[list[list[Any]]] = [[]]
        held = 0
        for p in batch:
            if entries[-1] and held + len(p.hashes) > self.max_blocks:
                entries.append([])
                held = 0
            entries[-1].append([p.node, p.placed_at, encode_hashes(p.hashes), p.session])
            held += len(p.hashes)
        return entries

    async def _read(self) -> None:
        if self._last_id is None:
            # A (re)started replica catches up on the last ttl_s of placements.
            self._last_id = f"{max(0, int((self._clock() - self.ttl_s) * 1000))}-0"
        learner = self._learner()
        for _ in range(10):
            reply = await self.client.client.xread({self.key: self._last_id}, count=_READ_BATCH)
            entries = reply[0][1] if reply else []
            for entry_id, fields in entries:
                self._last_id = entry_id
                if fields.get("r") != self.replica:
                    self._take(learner, fields.get("p", ""))
            if len(entries) < _READ_BATCH:
                return

    def _take(self, learner: Learner, packed: str) -> None:
        try:
            placements = orjson.loads(packed)
        except orjson.JSONDecodeError:
            return
        now = self._clock()
        for item in placements if isinstance(placements, list) else []:
            try:
                node, placed_at, hashes, session = item
                placed_at = float(placed_at)
            except (TypeError, ValueError):
                # Another version's entry: skipped, it is only a hint.
                continue
            if not isinstance(node, str) or not node or now - placed_at > self.ttl_s:
                continue
            session = session if isinstance(session, str) else None
            text = hashes if isinstance(hashes, str) else ""
            learner.learn(node, decode_hashes(text), session, placed_at)
            self.learned += 1
