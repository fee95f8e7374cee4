"""A GGUF file's vocabulary -> a tokenizers BPE (synthetic files; the real model when installed)."""

from __future__ import annotations

import io
import struct
from typing import Any

import pytest

from proxy.core.gguf_tokenizer import build_tokenizer, read_vocab
from proxy.core.tokenizer import load_counter
from tests.support.llama_servers import require_llama

# GPT-2's byte-level alphabet for the bytes used below: "Ġ" is the space.
TOKENS = ["<|im_start|>", "h", "i", "Ġ", "t", "1", "2", "hi", "Ġt", "Ġhi", "12"]
TYPES = [3] + [1] * (len(TOKENS) - 1)
MERGES = ["h i", "Ġ t", "Ġ hi", "1 2"]


def gguf_string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_kv(key: str, kind: int, value: Any) -> bytes:
    out = gguf_string(key) + struct.pack("<I", kind)
    if kind == 8:
        return out + gguf_string(value)
    if kind == 9:
        item, items = value
        out += struct.pack("<IQ", item, len(items))
        if item == 8:
            return out + b"".join(gguf_string(v) for v in items)
        return out + b"".join(struct.pack("<i", v) for v in items)
    return out + struct.pack({4: "<I", 7: "<?", 6: "<f"}[kind], value)


def gguf(pre: str = "smollm", model: str = "gpt2", version: int = 3) -> bytes:
    kvs = [
        gguf_kv("general.architecture", 8, "llama"),
        gguf_kv("llama.context_length", 4, 8192),
        gguf_kv("general.skipped_floats", 9, (5, [1, 2, 3])),
        gguf_kv("tokenizer.ggml.model", 8, model),
        gguf_kv("tokenizer.ggml.pre", 8, pre),
        gguf_kv("tokenizer.ggml.add_bos_token", 7, False),
        gguf_kv("tokenizer.ggml.tokens", 9, (8, TOKENS)),
        gguf_kv("tokenizer.ggml.token_type", 9, (5, TYPES)),
        gguf_kv("tokenizer.ggml.merges", 9, (8, MERGES)),
        gguf_kv("tokenizer.chat_template", 8, "{{ messages }}"),
    ]
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(kvs)) + b"".join(kvs)


def test_reads_only_the_tokenizer_keys() -> None:
    vocab = read_vocab(io.BytesIO(gguf()))
    assert set(vocab) == {"model", "pre", "add_bos_token", "tokens", "token_type", "merges"}
    assert vocab["tokens"] == TOKENS and vocab["merges"] == MERGES


def test_the_bpe_merges_and_splits_digits_one_by_one() -> None:
    tok = build_tokenizer(read_vocab(io.BytesIO(gguf())))
    assert tok.encode("hi hi", add_special_tokens=False).tokens == ["hi", "Ġhi"]
    # smollm splits each digit alone, so the "1 2" merge never applies across digits.
    assert tok.encode("12", add_special_tokens=False).tokens == ["1", "2"]
    # A control token in text is one token, as the server parses a rendered template.
    assert len(tok.encode("<|im_start|>hi", add_special_tokens=False).ids) == 2


def test_gpt2_pre_tokenizer_keeps_digit_runs_together() -> None:
    tok = build_tokenizer(read_vocab(io.BytesIO(gguf(pre="gpt2"))))
    assert tok.encode("12", add_special_tokens=False).tokens == ["12"]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GGML" + bytes(20), "not a GGUF file"),
        (gguf(version=1), "version 1"),
        (gguf()[:200], "ends inside"),
    ],
)
def test_bad_files_raise(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_vocab(io.BytesIO(data))


@pytest.mark.parametrize(
    ("pre", "model", "match"),
    [("llama3", "gpt2", "pre-tokenizer 'llama3'"), ("default", "llama", "model 'llama'")],
)
def test_unsupported_vocabularies_say_so(pre: str, model: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_tokenizer(read_vocab(io.BytesIO(gguf(pre=pre, model=model))))


# Counts llama-server (build 10434) gave for these texts with SmolLM2-135M's vocabulary
# (POST /tokenize, parse_special: true); cl100k counts differ on all but the first.
SERVER_COUNTS = [
    ("Hello, world! This is a test.", 9),
    ("word1 is here word22 is there 3.14159 and 2026-12-06", 29),
    ("Ünïcödé — “quotes” 日本語のテキスト 🚀 emoji", 34),
    ("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", 11),
]


@pytest.mark.parametrize(("text", "expected"), SERVER_COUNTS)
def test_the_real_models_vocabulary_counts_as_the_server(text: str, expected: int) -> None:
    _binary, path = require_llama()
    counter = load_counter(tokenizer_file=path)
    assert counter.count(text) == expected
    assert counter.id.startswith("hf:SmolLM2-135M-Instruct.Q4_1.gguf:")
