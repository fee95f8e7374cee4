"""One engine's (one data-parallel rank's) KV-event stream, followed into its exact index.

The protocol is vLLM's (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

* SUB socket on the publisher's PUB endpoint, subscribed to the topic; each message is
  ``[topic, seq (8 bytes big-endian), payload]``. PUB/SUB drops what a slow or absent
  subscriber misses, so the sequence number is checked on every message.
* Replay: a ROUTER socket. The request is the start sequence number (8 bytes big-endian)
  after an empty delimiter; the answer is every buffered ``[seq, payload]`` from there on,
  then ``[-1, b""]`` as the end marker. A DEALER socket speaks it here (vLLM's example uses
  REQ, which cannot take several answers to one request).

What is done with the sequence (``on_message``):

* the next number: applied;
* a gap: replay from the first missing one; when the replay does not start there (the
  publisher's buffer moved on) or fails, the index is dropped and rebuilt from what follows
  (a partial index only ever under-states what is cached);
* a number not above the last one *seen on this socket*: the publisher restarted (its
  counter starts again at 0, and its cache is empty): the index is dropped, and the new
  publisher's history is replayed from 0;
* the first message after connecting, or after the publisher disconnected (a restart whose
  counter already passed ours looks like no gap at all): the index is rebuilt from a replay
  from 0 (the buffer holds the last 10,000 batches by default, usually the whole cache's
  making; what it no longer holds is left out, which only under-states the cache).

Nothing here is on a request's path: routing reads the index the feed fills, never the
socket. But the feed runs on the gateway's event loop, so it applies events in pieces of at
most ``SLICE_BLOCKS`` blocks and lets the loop run between them: a long prompt's store
(2,000 blocks, ~3 ms to apply) or a replay of thousands of batches never holds requests up for more
than one piece (a piece applied is a consistent, shorter cache: a request that reads the
index meanwhile sees less cached, never more). A socket error closes the socket and
reconnects after a pause (``session`` is the round of a ``PeriodicTask``); ZeroMQ itself
reconnects to a publisher that comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from proxy.core.exact_prefix import EngineIndex
from proxy.core.kv_events import (
    AllBlocksCleared,
    Event,
    MalformedEvent,
    decode_batch,
    sequence_number,
    slices,
)

log = logging.getLogger("kvroute.kv_events")

#: Pause before reconnecting after a socket error.
RETRY_S = 0.5
_END = -1
#: A replay answer longer than this is refused (vLLM buffers 10,000 batches by default).
MAX_REPLAY_BATCHES = 100_000
#: Blocks applied between two turns of the event loop (~0.4 ms of work each).
SLICE_BLOCKS = 256


@dataclass(slots=True)
class FeedStats:
    """Counters of one feed, read by the metrics collector at scrape time."""

    batches: int = 0
    events: int = 0
    malformed: int = 0
    gaps: int = 0
    replays_ok: int = 0
    replays_short: int = 0
    restarts: int = 0
    disconnects: int = 0
    last_message_at: float = 0.0
    #: True once the index mirrors the engine (a message or a replay got through).
    synced: bool = False


class RankFeed:
    """Follow one publisher into ``index``; ``run()`` until cancelled."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        index: EngineIndex,
        clock: Callable[[], float],
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.clock = clock
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.stats = FeedStats()
        self._applied: int | None = None
        self._seen_on_sub: int | None = None
        self._disconnected = False

    async def session(self) -> None:
        """One SUB connection, followed until a socket error (a ``PeriodicTask`` round)."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        watch = asyncio.get_running_loop().create_task(self._watch_disconnects(monitor))
        try:
            sub.connect(self.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            if self._applied is None:
                await self._initial_replay()
            while True:
                frames = await sub.recv_multipart()
                await self.on_message(frames)
        except zmq.ZMQError:
            self.stats.synced = False
            raise
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await watch
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _initial_replay(self) -> None:
        """What the engine holds already: an idle engine publishes nothing to learn it from."""
        if self.replay_endpoint is None:
            return
        got = await self._ask_replay(0)
        if got is None:
            return
        await self._apply_replayed(got)
        # Even an empty answer is the engine's word: nothing stored yet.
        self.stats.synced = True
        self.stats.last_message_at = self.clock()

    async def _watch_disconnects(self, monitor: zmq.asyncio.Socket) -> None:
        """The publisher went away: whatever comes next may be a new process (see ``on_message``)."""
        while True:
            await monitor.recv_multipart()
            self.stats.disconnects += 1
            self._disconnected = True

    def on_error(self, exc: Exception) -> None:
        log.warning("kv events from %s: %s; reconnecting", self.endpoint, exc)

    async def on_message(self, frames: list[bytes]) -> None:
        """One SUB message: check its sequence, fill what was missed, apply it."""
        if len(frames) != 3:
            self.stats.malformed += 1
            return
        try:
            seq = sequence_number(frames[1])
        except MalformedEvent:
            self.stats.malformed += 1
            return
        if self._disconnected:
            # After a disconnect the publisher may be a new process whose counter already
            # passed ours: nothing tells a blip from a restart, so rebuild from its replay.
            self._disconnected = False
            self._seen_on_sub = None
            self._reset()
        before, self._seen_on_sub = self._seen_on_sub, seq
        if before is not None and seq <= before:
            # A publisher's counter only grows: this is a new publisher (engine restart).
            self.stats.restarts += 1
            self._reset()
        if self._applied is None or seq > self._applied + 1:
            start = 0 if self._applied is None else self._applied + 1
            if self._applied is not None:
                self.stats.gaps += 1
            if start < seq and not await self._replay(start, seq):
                if self._applied is not None:
                    # Missed events no replay can give back: what the index says is unsure.
                    self._reset()
        if self._applied is None or seq > self._applied:
            await self._apply(seq, frames[2])

    def _reset(self) -> None:
        self.index.clear()
        self._applied = None

    async def _apply(self, seq: int, payload: bytes) -> None:
        self._applied = seq
        self.stats.last_message_at = self.clock()
        self.stats.synced = True
        try:
            batch = decode_batch(payload)
        except MalformedEvent:
            self.stats.malformed += 1
            return
        self.stats.batches += 1
        self.stats.malformed += batch.skipped
        self.stats.events += len(batch.events)
        await self._apply_events(batch.events)

    async def _apply_events(self, events: tuple[Event, ...]) -> None:
        """Apply in pieces of ``SLICE_BLOCKS`` blocks, the loop running between pieces."""
        done = 0
        for event in events:
            for piece in slices(event, SLICE_BLOCKS):
                self.index.apply(piece)
                done += 1 if isinstance(piece, AllBlocksCleared) else len(piece.block_hashes)
                if done >= SLICE_BLOCKS:
                    done = 0
                    await asyncio.sleep(0)

    async def _replay(self, start: int, upto: int) -> bool:
        """Ask for every batch from ``start``; True when the answer covered ``start..upto-1``."""
        if self.replay_endpoint is None:
            self.stats.replays_short += 1
            return False
        got = await self._ask_replay(start)
        if got is None or not got or got[0][0] != start:
            self.stats.replays_short += 1
            if start == 0 and got:
                # The first connection: the history the buffer still holds is better than none.
                await self._apply_replayed(got)
            return False
        await self._apply_replayed(got)
        self.stats.replays_ok += 1
        return self._applied is not None and self._applied >= upto - 1

    async def _apply_replayed(self, got: list[tuple[int, bytes]]) -> None:
        for seq, payload in got:
            if self._applied is None or seq == self._applied + 1:
                await self._apply(seq, payload)

    async def _ask_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self.replay_timeout_ms):
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    self.stats.malformed += 1
                    return None
                seq = sequence_number(frames[1])
                if seq == _END:
                    return out
                out.append((seq, frames[2]))
                if len(out) > MAX_REPLAY_BATCHES:
                    return None
        except (zmq.ZMQError, MalformedEvent) as e:
            log.info("kv events replay from %s failed: %s", self.replay_endpoint, e)
            return None
        finally:
            with contextlib.suppress(Exception):
                dealer.close(linger=0)
