"""The simulated vLLM's prefix cache: shared and reused prompt blocks, eviction, faster prefill."""

from __future__ import annotations

import pytest

from loadtest.engine.behaviours.prefix_cache import PrefixCache, prompt_block_hashes
from loadtest.engine.behaviours.scheduler import LONG_PROMPT, PagedCore, SimRequest

BS = 16


def core(blocks: int, prefill_tokens_per_s: float = 1_000.0) -> PagedCore:
    return PagedCore(blocks, BS, 64, 1.0, prefill_tokens_per_s, prefix_caching=True)


def doc_req(doc: int, blocks: int, extra: int, max_tokens: int = 2) -> SimRequest:
    hashes = tuple(hash((doc, i)) for i in range(blocks))
    return SimRequest(blocks * BS + extra, max_tokens, 0.0, hashes=hashes)


def test_a_running_requests_prompt_blocks_are_shared_not_allocated_again() -> None:
    c = core(100)
    a = doc_req(1, 10, 5)
    c.submit(a, 0.0)
    assert c.free_blocks == 100 - 11
    b = doc_req(1, 10, 5)
    c.submit(b, 0.0)
    # Only b's own partial block is new; its 10 prompt blocks are a's.
    assert c.free_blocks == 100 - 12
    assert c.stats.prefix_hits == 10 * BS and c.stats.prefix_queries == 2 * (10 * BS + 5)
    # Cached tokens skip prefill: b starts decoding 160 tokens' prefill earlier than a did.
    assert b.decode_at == pytest.approx(a.decode_at - 10 * BS / 1_000.0)


def test_freed_prompt_blocks_stay_cached_until_the_allocator_needs_them() -> None:
    c = core(12)
    a = doc_req(1, 10, 0, max_tokens=1)
    c.submit(a, 0.0)
    c.step(100.0, 1)
    assert a.done and c.free_blocks == 12
    b = doc_req(1, 10, 0, max_tokens=1)
    c.submit(b, 100.0)
    # All ten blocks found in the free pool; the last token is computed anyway, as in vLLM.
    assert c.stats.prefix_hits == 10 * BS - 1
    c.step(200.0, 1)
    # A different 12-block prompt needs every block: the cached document is evicted.
    other = doc_req(2, 12, 0, max_tokens=1)
    c.submit(other, 200.0)
    c.step(300.0, 1)
    again = doc_req(1, 10, 0, max_tokens=1)
    hits = c.stats.prefix_hits
    c.submit(again, 300.0)
    assert c.stats.prefix_hits == hits  # nothing left


def test_release_frees_tail_blocks_first() -> None:
    cache = PrefixCache()
    cache.acquire([1, 2, 3])
    assert cache.release([1, 2, 3]) == 3
    cache.trim(1)
    assert list(cache.evictable) == [1]  # the document's start survives longest
    assert cache.lookup([1, 2]) == (1, 0)


def test_engine_hashes_share_leading_blocks_of_a_shared_document() -> None:
    doc = "alpha beta gamma delta " * 100
    q1 = {"messages": [{"role": "user", "content": doc + "first question? " * 20}]}
    q2 = {"messages": [{"role": "user", "content": doc + "another one entirely " * 20}]}
    a, b = prompt_block_hashes(q1, BS), prompt_block_hashes(q2, BS)
    common = sum(1 for x, y in zip(a, b, strict=False) if x == y)
    assert common >= 20 and a[:common] == b[:common] and a != b


def test_serial_prefill_makes_a_request_wait_for_the_prefill_before_it() -> None:
    # One GPU: b's prompt is prefilled after a's, and a cache hit shortens what b waits for.
    c = PagedCore(100, BS, 64, 1.0, 1_000.0, prefix_caching=True, serial_prefill=True)
    a = doc_req(1, 10, 5)
    b = doc_req(2, 10, 5)
    c.submit(a, 0.0)
    c.submit(b, 0.0)
    assert a.decode_at == pytest.approx(0.165)
    assert b.decode_at == pytest.approx(0.330)
    # A third request about a's document (cached: only its 5 own tokens are computed).
    d = doc_req(1, 10, 5)
    c.submit(d, 0.0)
    assert d.decode_at == pytest.approx(0.335)
    # Without serial prefill all three prefill at once, each at full speed.
    p = core(100)
    x, y = doc_req(1, 10, 5), doc_req(2, 10, 5)
    p.submit(x, 0.0)
    p.submit(y, 0.0)
    assert x.decode_at == y.decode_at == pytest.approx(0.165)


def test_long_prompts_wait_for_the_prefill_before_them_and_it_is_counted() -> None:
    c = PagedCore(2_000, BS, 64, 1.0, 10_000.0, prefix_caching=True, serial_prefill=True)
    a = doc_req(1, LONG_PROMPT // BS, 0)
    b = doc_req(2, LONG_PROMPT // BS, 0)
    chat = doc_req(3, 2, 0)
    c.submit(a, 0.0)
    c.submit(b, 0.0)
    c.submit(chat, 0.0)
    # b waited for a's prefill (0.8 s); the short chat is not counted among long prompts.
    assert c.stats.long_waits == 2
    assert c.stats.long_wait_s == pytest.approx(LONG_PROMPT / 10_000.0)


class Heard:
    """What the cache told its listener."""

    def __init__(self) -> None:
        self.said: list[str] = []

    def stored(self, hashes: object, parent: object, token_ids: object, block_size: int) -> None:
        self.said.append("stored")

    def removed(self, hashes: object) -> None:
        self.said.append("removed")

    def cleared(self) -> None:
        self.said.append("cleared")


def test_a_cache_reset_forgets_every_block_and_running_ones_are_freed_uncached() -> None:
    heard = Heard()
    c = PagedCore(100, BS, 64, 1.0, 1_000.0, prefix_caching=True)
    assert c.prefix is not None
    c.prefix.listener = heard
    done, running = doc_req(1, 10, 0, max_tokens=1), doc_req(2, 10, 0, max_tokens=50)
    c.submit(done, 0.0)
    c.submit(running, 0.0)
    c.step(100.0, 1)
    assert done.done and not running.done
    assert c.prefix.lookup(done.hashes)[0] == 10
    assert c.prefix.lookup(running.hashes) == (10, 10)
    free = c.free_blocks
    assert c.prefix.reset() == 10
    assert heard.said[-1] == "cleared"
    # Nothing is found by hash any more: neither the free cached blocks nor the running ones.
    assert c.prefix.lookup(done.hashes)[0] == 0
    assert c.prefix.lookup(running.hashes)[0] == 0
    # The running request keeps its memory; at its end its blocks are freed, not cached.
    assert c.free_blocks == free
    c.step(200.0, 60)
    assert running.done
    assert c.free_blocks == 100
    assert c.prefix.lookup(running.hashes)[0] == 0
    assert not c.prefix.evictable and not c.prefix.orphans
