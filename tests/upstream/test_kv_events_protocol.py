"""vLLM's KV-event protocol over real ZeroMQ sockets: the feed against vLLM-shaped publishers.

Message bytes are built with msgspec structs mirroring vLLM's, in both encodings it shipped
(``loadtest.engine.behaviours.kv_event_structs``), sent by the simulated engine's publisher
(PUB ``[topic, seq, payload]`` + replay ROUTER), or by a raw PUB socket for garbage.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from loadtest.engine.behaviours import kv_event_structs as ks
from loadtest.engine.behaviours.kv_publisher import KvPublisher
from proxy.backends import kv_feed
from proxy.backends.kv_events import KvEventFeeds
from proxy.core.prefix import block_hashes
from tests.support.gateway import gateway_cfg
from tests.support.kv_events import free_ports, options, publish_until, running_feed, wait_for

BS = 16
DOC_A = list(range(5_000, 5_000 + 4 * BS))
DOC_B = list(range(9_000, 9_000 + 4 * BS))
ENCODINGS = ["map", "array", "batch_array"]


def keys(tag: str, n: int = 4) -> list[ks.ExternalBlockHash]:
    """Engine block hashes: bytes as newer vLLM sends, ints for older."""
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]


def held(feed_index: object, doc: list[int]) -> int:
    return feed_index.match(block_hashes(doc, BS)).gpu_blocks  # type: ignore[attr-defined]


def heartbeat(enc: ks.Encoding) -> list[object]:
    return [ks.removed(enc, [b"not-held"])]


@pytest.mark.parametrize("enc", ENCODINGS)
async def test_a_sequence_gap_is_answered_from_the_replay_socket(enc: ks.Encoding) -> None:
    opts = options(encoding=enc)
    pub = KvPublisher(opts, 0)
    pub.start()
    try:
        async with running_feed(opts) as feed:
            await publish_until(pub, feed, lambda: heartbeat(enc), "the feed subscribed")
            a = keys("a")
            pub.publish([ks.stored(enc, a[:2], None, DOC_A[: 2 * BS], BS)], drop=True)
            pub.publish([ks.stored(enc, a[2:], a[1], DOC_A[2 * BS :], BS)])
            await wait_for(lambda: held(feed.index, DOC_A) == 4, "the replayed parent chained")
            assert feed.stats.gaps == 1
            assert feed.stats.replays_short == 0
            assert feed.stats.malformed == 0
    finally:
        await pub.close()


async def test_a_replay_that_cannot_cover_the_gap_drops_the_index_and_rebuilds() -> None:
    opts = options(encoding="map", buffer_steps=2)
    pub = KvPublisher(opts, 0)
    pub.start()
    try:
        async with running_feed(opts) as feed:
            await publish_until(pub, feed, lambda: heartbeat("map"), "the feed subscribed")
            short_before = feed.stats.replays_short
            pub.publish([ks.stored("map", keys("a"), None, DOC_A, BS)])
            await wait_for(lambda: held(feed.index, DOC_A) == 4, "doc A stored")
            for _ in range(3):  # lost, and pushed out of a 2-batch buffer
                pub.publish(heartbeat("map"), drop=True)
            pub.publish([ks.stored("map", keys("b"), None, DOC_B, BS)])
            await wait_for(lambda: held(feed.index, DOC_B) == 4, "doc B stored after the gap")
            assert feed.stats.gaps == 1
            assert feed.stats.replays_short == short_before + 1
            # What the missed batches did is unknown: the index was dropped, A with it.
            assert held(feed.index, DOC_A) == 0
    finally:
        await pub.close()


async def test_a_long_store_is_applied_in_pieces_with_the_loop_running_between_them() -> None:
    # A 32k-token prompt's store: requests on the gateway's loop must not wait for all of it.
    opts = options()
    pub = KvPublisher(opts, 0)
    pub.start()
    seen: set[int] = set()
    try:
        async with running_feed(opts) as feed:
            await publish_until(pub, feed, lambda: heartbeat("map"), "the feed subscribed")
            n = 2_000
            doc = [(7 * i) % 50_000 for i in range(n * BS)]

            async def watch() -> None:
                # Another task on the loop (a request): what does it see, turn by turn?
                while True:
                    seen.add(feed.index.blocks())
                    await asyncio.sleep(0)

            watcher = asyncio.create_task(watch())
            pub.publish([ks.stored("map", list(range(1, n + 1)), None, doc, BS)])
            await wait_for(lambda: held(feed.index, doc) == n, "the whole store applied")
            watcher.cancel()
            # It ran while the store was partly applied, again and again (pieces of 256 blocks).
            assert kv_feed.SLICE_BLOCKS <= 500
            assert len({b for b in seen if 0 < b < n}) >= 3, seen
            assert feed.stats.malformed == 0
    finally:
        await pub.close()


async def test_data_parallel_ranks_publish_on_port_plus_rank_into_their_own_index() -> None:
    base = free_ports(4)
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 2}"
    backend = {
        "name": "dp",
        "url": "http://127.0.0.1:9",
        "kind": "vllm",
        "kv_events": {"endpoint": endpoint, "replay_endpoint": replay, "ranks": 2},
    }
    cfg = gateway_cfg([backend])
    loop = asyncio.get_running_loop()
    feeds = KvEventFeeds(lambda: cfg, lambda: None, loop.time)
    opts = options()
    opts = type(opts)(endpoint=endpoint, replay_endpoint=replay)
    pubs = [KvPublisher(opts, 0), KvPublisher(opts, 1)]
    for p in pubs:
        p.start()
    feeds.start()
    try:
        await wait_for(lambda: len(feeds.feeds()) == 2, "two rank feeds")
        by_rank = {rank: feed for _name, rank, feed in feeds.feeds()}
        assert by_rank[0].endpoint == endpoint and by_rank[1].endpoint.endswith(f":{base + 1}")
        assert by_rank[1].replay_endpoint == f"tcp://127.0.0.1:{base + 3}"
        for rank, p in enumerate(pubs):
            await publish_until(p, by_rank[rank], lambda: heartbeat("map"), f"rank {rank}")
        pubs[0].publish([ks.stored("map", keys("a"), None, DOC_A, BS)])
        pubs[1].publish([ks.stored("map", keys("b"), None, DOC_B, BS)])
        await wait_for(lambda: held(by_rank[1].index, DOC_B) == 4, "rank 1 holds B")
        await wait_for(lambda: held(by_rank[0].index, DOC_A) == 4, "rank 0 holds A")
        assert held(by_rank[0].index, DOC_B) == 0 and held(by_rank[1].index, DOC_A) == 0
        now = loop.time()
        assert feeds.source("dp", now) == "events"
        assert feeds.cached("dp", block_hashes(DOC_A, BS), now) == 4 * BS
        assert feeds.cached("dp", block_hashes(DOC_B, BS), now) == 4 * BS
    finally:
        await feeds.stop()
        for p in pubs:
            await p.close()


@pytest.mark.parametrize("enc", ENCODINGS)
async def test_all_blocks_cleared_after_an_engine_restart(enc: ks.Encoding) -> None:
    opts = options(encoding=enc)
    first = KvPublisher(opts, 0)
    first.start()
    async with running_feed(opts) as feed:
        try:
            await publish_until(first, feed, lambda: heartbeat(enc), "the feed subscribed")
            first.publish([ks.stored(enc, keys("a"), None, DOC_A, BS)])
            await wait_for(lambda: held(feed.index, DOC_A) == 4, "doc A stored")
            # The old counter runs well ahead, so the new one reads as a restart even if the
            # disconnect were noticed late (the feed watches both).
            seen = feed.stats.batches
            for _ in range(100):
                first.publish(heartbeat(enc))
            await wait_for(lambda: feed.stats.batches >= seen + 100, "the old counter at 100+")
        finally:
            await first.close()
        # The engine comes back on the same endpoints: a new publisher, counting from 0.
        second = KvPublisher(opts, 0)
        second.start()
        try:
            second.publish([ks.cleared(enc)])
            second.publish([ks.stored(enc, keys("b"), None, DOC_B, BS)])
            await publish_until(second, feed, lambda: heartbeat(enc), "the restarted publisher")
            await wait_for(lambda: held(feed.index, DOC_B) == 4, "doc B from the new engine")
            assert held(feed.index, DOC_A) == 0
            assert feed.stats.disconnects + feed.stats.restarts >= 1
            # And in-stream: a prefix-cache reset clears everything.
            second.publish([ks.cleared(enc)])
            await wait_for(lambda: feed.index.blocks() == 0, "cleared")
        finally:
            await second.close()


async def test_garbage_frames_are_counted_and_skipped_and_the_feed_goes_on() -> None:
    opts = options(replay=False)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.PUB)
    raw.bind(opts.endpoint)
    seq = 0

    async def send(payload: bytes, seq_frame: bytes | None = None) -> None:
        nonlocal seq
        frame = seq_frame if seq_frame is not None else seq.to_bytes(8, "big")
        seq += 1
        await raw.send_multipart([b"", frame, payload])

    good = ks.batch_bytes("map", [ks.removed("map", [b"x"])])
    try:
        async with running_feed(opts) as feed:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while feed.stats.batches == 0:
                assert loop.time() < deadline, "feed never subscribed"
                await send(good)
                await asyncio.sleep(0.02)
            bad_event = {
                "ts": 1.0,
                "events": [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2]}],
            }
            import msgspec

            await raw.send_multipart([b"", b"only two frames"])
            await send(good, seq_frame=b"\x00" * 7)
            await send(b"\xc1\xc1 not msgpack")
            await send(msgspec.msgpack.encode({"ts": "soon", "events": []}))
            await send(msgspec.msgpack.encode([1.0, [["BlockStored", "nope"]], -3]))
            await send(msgspec.msgpack.encode(bad_event))
            await send(ks.batch_bytes("map", [ks.stored("map", keys("a"), None, DOC_A, BS)]))
            await wait_for(lambda: held(feed.index, DOC_A) == 4, "the good batch after garbage")
            assert feed.stats.malformed == 6
    finally:
        ctx.destroy(linger=0)


async def test_a_backend_whose_events_stop_falls_back_and_a_moved_endpoint_is_followed() -> None:
    opts = options()
    backend: dict[str, object] = {
        "name": "x",
        "url": "http://127.0.0.1:9",
        "kind": "vllm",
        "kv_events": {"endpoint": opts.endpoint, "replay_endpoint": opts.replay_endpoint},
    }
    current = {"cfg": gateway_cfg([backend], routing={"prefix": {"events": {"reconcile_s": 0.05}}})}
    loop = asyncio.get_running_loop()
    feeds = KvEventFeeds(lambda: current["cfg"], lambda: None, loop.time)
    pub = KvPublisher(opts, 0)
    pub.start()
    feeds.start()
    moved: KvPublisher | None = None
    try:
        await wait_for(lambda: feeds.source("x", loop.time()) == "events", "synced by replay")
        stale = current["cfg"].routing.prefix.events.stale_after_s
        # A placement of blocks the engine lacks must be answered by events...
        t0 = loop.time()
        feeds.placed("x", block_hashes(DOC_A, BS), t0)
        assert feeds.source("x", t0 + stale / 2) == "events"
        # ...or the backend is back on the approximate index.
        assert feeds.source("x", t0 + stale + 1) == "approximate"
        assert feeds.cached("x", block_hashes(DOC_A, BS), t0 + stale + 1) is None
        pub.publish([ks.stored("map", keys("a"), None, DOC_A, BS)])
        await wait_for(lambda: feeds.source("x", loop.time()) == "events", "answered")
        # The backend moves to new endpoints (a reload or discovery): the feed follows.
        moved_opts = options()
        moved = KvPublisher(moved_opts, 0)
        moved.start()
        backend["kv_events"] = {
            "endpoint": moved_opts.endpoint,
            "replay_endpoint": moved_opts.replay_endpoint,
        }
        current["cfg"] = gateway_cfg(
            [backend], routing={"prefix": {"events": {"reconcile_s": 0.05}}}
        )
        await wait_for(
            lambda: [f.endpoint for _n, _r, f in feeds.feeds()] == [moved_opts.endpoint],
            "re-pointed",
        )
        moved.publish([ks.stored("map", keys("b"), None, DOC_B, BS)])
        # A message sent before the new SUB is subscribed is lost with nothing after it to
        # show the gap: later traffic (here heartbeats) reveals it and the replay fills it.
        deadline = loop.time() + 10
        while feeds.cached("x", block_hashes(DOC_B, BS), loop.time()) != 4 * BS:
            assert loop.time() < deadline, "the moved engine's events never arrived"
            moved.publish(heartbeat("map"))
            await asyncio.sleep(0.02)
    finally:
        await feeds.stop()
        await pub.close()
        if moved is not None:
            await moved.close()
