"""One encode per request: sizing's count and the prefix hashes come from the same token ids.

The expected demand comes from a sizer with prefix affinity off (no pieces cache: the
counting path as it was), the expected hashes from ``prompt_pieces`` + ``pieces_hashes`` with
a fresh encoder, one piece per text and no cache. The spy counts every text the tokenizer is asked to encode.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import threading
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

import orjson
import pytest
from starlette.requests import Request

from loadtest.workload import make_prompt
from proxy.config import Config, parse_config
from proxy.core.chain_hash import pieces_hashes
from proxy.core.prefix_prompt import prompt_pieces, text_pieces
from proxy.core.tokenizer import TiktokenCounter
from proxy.core.validation import ParsedRequest, parse_request
from proxy.gateway import sizing, sizing_pool
from proxy.gateway.affinity import Affinity
from tests.core.test_sizing import Spy as CountSpy

BIG = "the quick brown fox jumps over the lazy dog, again and again. " * 400  # ~25k chars
DOC = "a shared document about caches and routing " * 20  # inline-sized, cached (>= 256)


class Spy(CountSpy):
    """test_sizing's recording counter, recording the texts it encodes to ids as well."""

    def ids(self, text: str) -> Sequence[int]:
        self.seen.append(text)
        return self.inner.ids(text)


def config(**routing: Any) -> Config:
    data = {"backends": [{"name": "b", "url": "http://127.0.0.1:1"}], "routing": routing}
    return parse_config(data, "test", environ={})


def spied(cfg: Config) -> Spy:
    spy = Spy()
    s = sizing.sizer_for(cfg)
    s.default = replace(s.default, counter=spy)
    return spy


def parse(body: dict[str, Any]) -> ParsedRequest:
    return parse_request(orjson.dumps({"model": "m", **body}), "chat", 10**6)


def expected_hashes(body: dict[str, Any], cfg: Config) -> tuple[int, ...]:
    p = cfg.routing.prefix
    encode = text_pieces(TiktokenCounter())
    assert encode is not None
    pieces, _held = prompt_pieces(body, "x", encode, p.max_prompt_tokens)
    return tuple(pieces_hashes(pieces, p.block_tokens, p.max_prompt_tokens))


def expected_demand(body: dict[str, Any]) -> int:
    off = config(prefix={"enabled": False})
    assert sizing.sizer_for(off).pieces is None
    return sizing.sizer_for(off).size(parse(body)).total


def counting_hops(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    hops: list[object] = []
    real = asyncio.to_thread

    def to_thread(fn: Callable[..., Any], /, *a: Any, **kw: Any) -> Coroutine[Any, Any, Any]:
        hops.append(fn)
        return real(fn, *a, **kw)

    real_run = sizing_pool.run

    def run(fn: Callable[..., Any], *a: Any) -> Coroutine[Any, Any, Any]:
        hops.append(fn)
        return real_run(fn, *a)

    monkeypatch.setattr(asyncio, "to_thread", to_thread)
    monkeypatch.setattr(sizing_pool, "run", run)
    return hops


def http_request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": []})


@pytest.mark.parametrize("text", [BIG, DOC], ids=["worker-thread", "inline"])
async def test_each_text_is_encoded_once_for_count_and_hashes_in_one_hop(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config()
    spy = spied(cfg)
    affinity = Affinity(cfg)
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    hops = counting_hops(monkeypatch)
    parsed = parse(body)
    demand = await sizing.size_request(parsed, cfg)
    key = await affinity.key_of(http_request(), parsed)
    assert spy.seen.count(text) == 1
    assert len(hops) == (1 if text is BIG else 0)
    assert demand.total == expected_demand(body)
    assert key is not None and key.hashes == expected_hashes(body, cfg)
    assert len(key.hashes) > 0


async def test_turn_20_encodes_only_its_new_message_and_hashes_stay_exact() -> None:
    cfg = config()
    spy = spied(cfg)
    affinity = Affinity(cfg)
    history: list[dict[str, str]] = []
    for i in range(20):
        history.append({"role": "user", "content": f"question {i}: " + "tell me more " * 30})
        history.append({"role": "assistant", "content": f"answer {i}: " + "it helps " * 40})
    body: dict[str, Any] = {"messages": history}
    await sizing.size_request(parse(body), cfg)
    spy.seen.clear()
    new = "and one more question " * 20
    body = {"messages": [*history, {"role": "user", "content": new}]}
    parsed = parse(body)
    demand = await sizing.size_request(parsed, cfg)
    key = await affinity.key_of(http_request(), parsed)
    # Short strings (roles, the "<role>" markers) are not cached; every long one was, once.
    assert [s for s in spy.seen if len(s) >= 256] == [new]
    assert demand.total == expected_demand(body)
    assert key is not None and key.hashes == expected_hashes(body, cfg)


async def test_hashes_of_an_abandoned_request_do_not_stay_behind() -> None:
    cfg = config()
    parsed = parse({"messages": [{"role": "user", "content": DOC}]})
    # Entries of earlier tests' requests that are garbage but not yet collected would
    # otherwise leave with this one's at the collection below.
    gc.collect()
    before = len(sizing._hashes)
    await sizing.size_request(parsed, cfg)
    assert len(sizing._hashes) == before + 1
    # The request failed before affinity took its hashes: they go with it.
    del parsed
    gc.collect()
    assert len(sizing._hashes) == before


async def test_affinity_hashes_itself_when_sizing_used_another_config() -> None:
    cfg = config()
    affinity = Affinity(cfg)
    body = {"messages": [{"role": "user", "content": DOC}]}
    parsed = parse(body)
    # Sized with different prefix settings (a reload in between): those hashes do not apply.
    await sizing.size_request(parsed, config(prefix={"block_tokens": 32}))
    key = await affinity.key_of(http_request(), parsed)
    assert key is not None and key.hashes == expected_hashes(body, cfg)


def test_loading_the_sizer_starts_the_sizing_threads_before_the_first_request() -> None:
    async def go() -> set[threading.Thread]:
        before = set(threading.enumerate())
        await sizing.load_sizer(config())
        return set(threading.enumerate()) - before

    # A fresh pool: all its threads run once the sizer is loaded.
    sizing_pool.reset()
    started = asyncio.run(go())
    names = [t.name for t in started if t.name.startswith("kvroute-sizing")]
    assert len(names) == sizing_pool.THREADS


async def test_short_texts_are_encoded_once_and_repeated_ones_not_at_all() -> None:
    cfg = config()
    spy = spied(cfg)
    affinity = Affinity(cfg)
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    parsed = parse(body)
    await sizing.size_request(parsed, cfg)
    key = await affinity.key_of(http_request(), parsed)
    # Role, content and the "<user>" marker the prefix ids start with: each once.
    assert sorted(spy.seen) == sorted(["user", "Say hi.", "<user>"])
    assert key is not None and key.hashes == expected_hashes(body, cfg) == ()
    spy.seen.clear()
    again = parse(body)
    demand = await sizing.size_request(again, cfg)
    assert spy.seen == []
    assert demand.total == expected_demand(body)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")
async def test_big_requests_are_encoded_in_a_lowered_thread_the_loops_stays_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config()
    # Loaded first: loading starts and warms the sizing threads (hops of its own).
    await sizing.load_sizer(cfg)
    seen: list[tuple[int, int]] = []
    real = sizing.sizing_pool.run

    async def spy(fn: Any, *a: Any) -> Any:
        def where(*args: Any) -> Any:
            tid = threading.get_native_id()
            seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
            return fn(*args)

        return await real(where, *a)

    monkeypatch.setattr(sizing.sizing_pool, "run", spy)
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    # A text no other test sized: the process-wide chunk cache holds none of it.
    new = make_prompt(20_000, random.Random(uuid.uuid4().int))
    await sizing.size_request(parse({"messages": [{"role": "user", "content": new}]}), cfg)
    await sizing.size_request(parse({"messages": [{"role": "user", "content": "hi"}]}), cfg)
    # One hop for the big one (its encode), none for the small one.
    ((worker, worker_nice),) = seen
    assert worker != threading.get_native_id() and worker_nice >= sizing.WORKER_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    assert loop_nice < sizing.WORKER_NICE
