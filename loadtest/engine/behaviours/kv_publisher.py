"""The simulated vLLM's KV-cache event publisher: vLLM's ZeroMQ protocol, one per DP rank.

As ``ZmqEventPublisher`` in ``vllm/distributed/kv_events.py`` behaves (our own code):

* a PUB socket sends ``[topic, seq (8 bytes big-endian), payload]``, seq counting from 0
  per publisher (so from 0 again after a restart);
* a ROUTER socket answers a replay request ``[identity, b"", start (8 bytes)]`` with every
  buffered ``[identity, b"", seq, payload]`` from ``start`` on, then ``[identity, b"",
  -1 (8 bytes, signed), b""]``; the buffer keeps the last ``buffer_steps`` batches;
* data-parallel rank r binds the endpoint's port + r (``proxy.config.kv_events.for_rank``).

``KvEventsOptions.parse`` reads vLLM's ``--kv-events-config`` JSON (``enable_kv_cache_events``,
``publisher``, ``endpoint``, ``replay_endpoint``, ``topic``, ``buffer_steps``), plus our own
``encoding`` (``map``, newer vLLM; ``batch_array``, vLLM 0.28; ``array``, older) to
exercise every layout vLLM shipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from loadtest.engine.behaviours import kv_event_structs as ks
from proxy.config.kv_events import for_rank

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KvEventsOptions:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    encoding: ks.Encoding = "map"

    @classmethod
    def parse(cls, text: str) -> KvEventsOptions | None:
        """vLLM's ``--kv-events-config`` JSON; None when events are not enabled."""
        raw: Any = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        if not raw.get("enable_kv_cache_events", False):
            return None
        if raw.get("publisher", "zmq") != "zmq":
            raise ValueError("only the zmq publisher is simulated")
        encoding = raw.get("encoding", "map")
        if encoding not in ("map", "array", "batch_array"):
            raise ValueError("encoding must be map, array or batch_array")
        return cls(
            endpoint=str(raw.get("endpoint", cls.endpoint)),
            replay_endpoint=raw.get("replay_endpoint"),
            topic=str(raw.get("topic", "")),
            buffer_steps=int(raw.get("buffer_steps", 10_000)),
            encoding=encoding,
        )


class KvPublisher:
    """One rank's PUB + replay ROUTER; ``publish`` never blocks (PUB drops at its high-water mark)."""

    def __init__(self, options: KvEventsOptions, rank: int) -> None:
        self.options = options
        self.rank = rank
        self.encoding: ks.Encoding = options.encoding
        self._ctx = zmq.asyncio.Context()
        # PUB never blocks (it drops at its high-water mark): a plain socket, sent from the loop.
        self._sync_ctx = zmq.Context()
        self._pub = self._sync_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(for_rank(options.endpoint, rank))
        self._router: zmq.asyncio.Socket | None = None
        if options.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(for_rank(options.replay_endpoint, rank))
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_steps)
        self._seq = 0
        self._topic = options.topic.encode()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[msgspec.Struct], drop: bool = False) -> None:
        """Send one batch; ``drop`` (tests) buffers it for replay but loses it on the PUB."""
        if not events:
            return
        payload = ks.batch_bytes(self.encoding, events, self.rank, time.time())
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if drop:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(
                [self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            await self._router.send_multipart([ident, b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)


def wire_key(block_hash: int) -> bytes:
    """A block's hash as vLLM puts it on the wire: bytes (a sha256 digest there, 32 bytes; here
    the 64-bit hash's 8 bytes). Consumers take bytes (vllm-router refuses negative ints)."""
    return (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")


class PublishingListener:
    """A core's prefix cache -> its rank's publisher (``prefix_cache.CacheListener``)."""

    def __init__(self, publisher: KvPublisher) -> None:
        self.publisher = publisher

    def stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int
    ) -> None:
        enc = self.publisher.encoding
        keys: list[ks.ExternalBlockHash] = [wire_key(h) for h in hashes]
        up = wire_key(parent) if parent is not None else None
        self.publisher.publish([ks.stored(enc, keys, up, list(token_ids), block_size)])

    def removed(self, hashes: Sequence[int]) -> None:
        keys: list[ks.ExternalBlockHash] = [wire_key(h) for h in hashes]
        self.publisher.publish([ks.removed(self.publisher.encoding, keys)])

    def cleared(self) -> None:
        self.publisher.publish([ks.cleared(self.publisher.encoding)])


def attach_publishers(config_json: str | None, cores: Sequence[Any]) -> list[KvPublisher]:
    """One publisher per core (data-parallel rank) whose prefix cache it reports."""
    options = KvEventsOptions.parse(config_json) if config_json else None
    if options is None:
        return []
    out: list[KvPublisher] = []
    for rank, core in enumerate(cores):
        pub = KvPublisher(options, rank)
        if core.prefix is not None:
            core.prefix.listener = PublishingListener(pub)
        out.append(pub)
    return out
