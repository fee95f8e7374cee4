"""Sizing threads: each encodes with its own tokenizer copy (same ids), one digest per text."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
import types
from typing import Any

import pytest

from proxy.core import digest
from proxy.core.tokenizer import (
    SPLIT_ABOVE_CHARS,
    TiktokenCounter,
    _own_copy,
    own_encodings,
    safe_cut,
)
from proxy.gateway import sizing, sizing_pool
from tests.gateway.test_tokenize_once import BIG, config, expected_demand, expected_hashes, parse


def random_text(rng: random.Random, n: int) -> str:
    # Words, digits, punctuation, newlines, runs of spaces and some non-ASCII letters.
    pieces = ["the", "Über", "naïve", "42", "1999", "!!", "\n", "   ", "'s", "日本語", "\t", "x"]
    return " ".join(rng.choice(pieces) for _ in range(n))


async def test_sizing_threads_encode_with_their_own_copy_and_the_same_ids() -> None:
    counter = TiktokenCounter()
    shared = counter._enc
    rng = random.Random(5)
    texts = [random_text(rng, 3000) for _ in range(20)]

    def in_thread() -> tuple[bool, list[list[int]]]:
        return _own_copy(shared) is not shared, [list(counter.ids(t)) for t in texts]

    own, ids = await sizing_pool.run(in_thread)
    assert own
    assert ids == [shared.encode_ordinary(t) for t in texts]
    # Any other thread (the loop's here) shares the process's one encoding.
    assert _own_copy(shared) is shared


def test_a_thread_asks_for_copies_once_and_keeps_them() -> None:
    shared = TiktokenCounter()._enc
    got: list[object] = []

    def body() -> None:
        own_encodings()
        first = _own_copy(shared)
        own_encodings()
        got.extend([first, _own_copy(shared)])

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert got[0] is got[1] and got[0] is not shared


def counting_digests(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = hashlib.blake2b

    def blake2b(data: bytes = b"", **kw: Any) -> Any:
        sizes.append(len(data))
        return real(data, **kw)

    monkeypatch.setattr(digest, "hashlib", types.SimpleNamespace(blake2b=blake2b))
    # The BLAKE2b path (hash randomization off): Python's cached str hash needs no memo.
    no_random = types.SimpleNamespace(hash_randomization=0)
    monkeypatch.setattr(digest, "sys", types.SimpleNamespace(flags=no_random))
    return sizes


@pytest.mark.parametrize(
    ("text", "calls"), [(BIG, 2), (BIG[:4000], 1)], ids=["new-big-text", "inline"]
)
async def test_each_text_is_digested_once_per_sizing_call(
    monkeypatch: pytest.MonkeyPatch, text: str, calls: int
) -> None:
    cfg = config()
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
    sizes = counting_digests(monkeypatch)
    parsed = parse(body)
    demand = await sizing.size_request(parsed, cfg)
    # Message count, text count, ids for the count, ids for the hashes: one digest of it per
    # sizing call. A new big text is sized twice on the loop: a first try that finds chunks
    # missing, and again once a sizing thread has encoded them (proxy.gateway.sizing._size_big).
    assert sizes.count(len(text)) == calls
    assert demand.total == expected_demand(body)
    spec = sizing.hash_spec(sizing.sizer_for(cfg), parsed, cfg.routing.prefix)
    assert spec is not None
    assert sizing.take_hashes(parsed, spec) == expected_hashes(body, cfg)


def test_outside_a_sizing_call_no_digest_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = counting_digests(monkeypatch)
    with digest.memo(), digest.memo():
        assert digest.text_digest(BIG) == digest.text_digest(BIG)
    assert len(sizes) == 1
    digest.text_digest(BIG)
    digest.text_digest(BIG)
    assert len(sizes) == 3
    # Equal texts that are different objects get the same digest.
    assert digest.text_digest(BIG) == digest.text_digest("".join(list(BIG)))


def prose(rng: random.Random, words: int) -> str:
    # Words with contractions, digits, punctuation, runs of spaces, newlines, non-ASCII.
    vocab = ["cat", "it's", "we'll", "Über", "naïve", "2024", "x1", "—", "日本", "a", "I"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", "\t", " \n "]
    return "".join(rng.choice(vocab) + rng.choice(seps) for _ in range(words))


def test_safe_cuts_keep_the_ids_exact() -> None:
    enc = TiktokenCounter()._enc
    rng = random.Random(11)
    cuts = 0
    for _ in range(300):
        text = prose(rng, rng.randrange(20, 400))
        cut = safe_cut(text, rng.randrange(1, len(text)), window=rng.choice([8, 64, 4096]))
        if cut is None:
            continue
        cuts += 1
        assert text[cut] == " " and text[cut - 1].isalpha() and text[cut + 1].isalpha()
        whole = enc.encode_ordinary(text)
        assert enc.encode_ordinary(text[:cut]) + enc.encode_ordinary(text[cut:]) == whole
    assert cuts > 200
    # No space between two letters within reach: no cut.
    assert safe_cut("1, 2, 3, 4. " * 50, 300) is None


def test_a_split_encode_is_exact_whether_the_half_is_handed_over_or_taken_back() -> None:
    counter = TiktokenCounter()
    rng = random.Random(3)
    text = prose(rng, 12_000)
    assert len(text) >= SPLIT_ABOVE_CHARS
    whole = counter._enc.encode_ordinary(text)
    threads = sizing_pool.THREADS
    sizing_pool.configure(2)
    handing_over = True
    halves: list[str] = []
    both = threading.Event()
    real = TiktokenCounter._plain_ids

    def plain_ids(self: TiktokenCounter, t: str) -> Any:
        halves.append(threading.current_thread().name)
        if len(halves) == 1:
            # The first half waits (bounded) for the second to start: a free thread takes it.
            # The bound is generous: on a loaded machine a thread can wait seconds for the GIL.
            both.wait(20 if handing_over else 0)
        else:
            both.set()
        return real(self, t)

    try:
        TiktokenCounter._plain_ids = plain_ids  # type: ignore[method-assign,assignment]
        pool = sizing_pool.executor()
        # Both threads started and idle: the other thread encodes the second half.
        for f in [pool.submit(time.sleep, 0.05) for _ in range(2)]:
            f.result()
        handing_over = True
        assert list(pool.submit(counter.ids, text).result(timeout=60)) == whole
        assert len(halves) == 2 and halves[0] != halves[1]
        # The other thread busy: the half is taken back by the splitting thread itself.
        halves.clear()
        both.clear()
        handing_over = False
        gate = threading.Event()
        busy = pool.submit(gate.wait, 60)
        try:
            assert list(pool.submit(counter.ids, text).result(timeout=60)) == whole
            assert len(halves) == 2 and halves[0] == halves[1]
        finally:
            gate.set()
            busy.result()
    finally:
        TiktokenCounter._plain_ids = real  # type: ignore[method-assign]
        sizing_pool.configure(threads)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_child_sizes_in_threads_of_its_own() -> None:
    sizing_pool.executor().submit(int).result()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        # The parent's pool has no threads here; a fresh one must answer.
        ok = False
        try:
            ok = sizing_pool.executor().submit(lambda: 7).result(timeout=5) == 7
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"
