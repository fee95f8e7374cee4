"""Helpers for KV-event tests: free consecutive ports, a feed run in the test's loop, waits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import zmq.asyncio

from loadtest.engine.behaviours.kv_publisher import KvEventsOptions, KvPublisher
from loadtest.free_ports import free_ports as any_free_ports
from proxy.backends.kv_feed import RankFeed
from proxy.core.exact_prefix import EngineIndex


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports (data-parallel ranks bind base + rank),
    below the ephemeral range (``loadtest.free_ports``)."""
    return any_free_ports(n)


def options(
    replay: bool = True, encoding: str = "map", buffer_steps: int = 10_000
) -> KvEventsOptions:
    base = free_ports(4)
    return KvEventsOptions(
        endpoint=f"tcp://127.0.0.1:{base}",
        replay_endpoint=f"tcp://127.0.0.1:{base + 2}" if replay else None,
        buffer_steps=buffer_steps,
        encoding=encoding,  # type: ignore[arg-type]
    )


async def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``pred`` on the loop until true (the feed runs on the same loop)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running_feed(
    opts: KvEventsOptions, rank: int = 0, block_tokens: int = 16, max_blocks: int = 500_000
) -> AsyncIterator[RankFeed]:
    """A ``RankFeed`` on ``opts``' endpoints (rank offset applied), its session as a task."""
    from proxy.config.kv_events import for_rank

    ctx = zmq.asyncio.Context()
    replay = for_rank(opts.replay_endpoint, rank) if opts.replay_endpoint else None
    feed = RankFeed(
        ctx,
        for_rank(opts.endpoint, rank),
        replay,
        opts.topic,
        EngineIndex(block_tokens, max_blocks),
        asyncio.get_running_loop().time,
        replay_timeout_s=2.0,
    )
    task = asyncio.get_running_loop().create_task(feed.session())
    try:
        yield feed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.destroy(linger=0)


async def publish_until(
    pub: KvPublisher, feed: RankFeed, events_fn: Callable[[], list[object]], what: str
) -> None:
    """Publish a harmless batch until the feed has taken one in (PUB drops until subscribed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    start = feed.stats.batches
    while feed.stats.batches == start:
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        pub.publish(events_fn())  # type: ignore[arg-type]
        await asyncio.sleep(0.02)
