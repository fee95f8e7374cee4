"""A model's own tokenizer, built from the vocabulary inside its GGUF file.

A llama.cpp server counts prompts with the vocabulary stored in the model file (GGUF keys
``tokenizer.ggml.*``: the tokens, their types, the BPE merges, the pre-tokenizer's name).
Naming that ``.gguf`` file as a model's ``tokenizer_file`` makes the gateway count with the
same vocabulary: this reads those keys (the GGUF header and metadata only, never the
tensors) and builds an equivalent ``tokenizers`` byte-level BPE.

Supported: ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE) with the pre-tokenizers whose
split rules ``tokenizers`` expresses exactly: ``default``/``gpt2`` (GPT-2's regex) and
``smollm`` (each digit alone, then GPT-2's regex; llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``).
Anything else raises ``ValueError`` naming what it found: give the model's
``tokenizer.json`` instead. Control and user-defined tokens (``<|im_start|>``) count as one
token where they appear in text, as the server parses them in a rendered chat template.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MAGIC = b"GGUF"
PREFIX = "tokenizer.ggml."
# GGUF value types (ggml's gguf.h, enum gguf_type) -> struct format; 8 string, 9 array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# llama.cpp's token types (llama_token_type): these are matched whole in text.
_CONTROL, _USER_DEFINED = 3, 4
_PRE_TOKENIZERS = ("default", "gpt2", "smollm")


class _Reader:
    def __init__(self, f: IO[bytes]) -> None:
        self._f = f

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        raw = self._f.read(size)
        if len(raw) != size:
            raise ValueError("GGUF file ends inside its metadata")
        return struct.unpack(fmt, raw)[0]

    def string(self) -> str:
        n = self.take("<Q")
        raw = self._f.read(n)
        if len(raw) != n:
            raise ValueError("GGUF file ends inside a string")
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.take("<I"), self.take("<Q")
            if not keep and item in _SCALARS:
                self._f.seek(n * struct.calcsize(_SCALARS[item]), 1)
                return None
            return [self.value(item, keep) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"GGUF value type {kind} is unknown")
        return self.take(_SCALARS[kind])


def read_vocab(f: IO[bytes]) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file (versions 2 and 3), prefix removed."""
    r = _Reader(f)
    if f.read(4) != MAGIC:
        raise ValueError("not a GGUF file")
    version = r.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    r.take("<Q")  # tensor count
    out: dict[str, Any] = {}
    for _ in range(r.take("<Q")):
        key = r.string()
        keep = key.startswith(PREFIX) and key != PREFIX + "chat_template"
        value = r.value(r.take("<I"), keep)
        if keep:
            out[key.removeprefix(PREFIX)] = value
    return out


def build_tokenizer(vocab: dict[str, Any]) -> Tokenizer:
    """A ``tokenizers`` tokenizer equivalent to the GGUF vocabulary ``vocab`` (``read_vocab``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model, pre = vocab.get("model"), vocab.get("pre", "default")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only gpt2 BPE)")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported ({', '.join(_PRE_TOKENIZERS)}): "
            "give the model's tokenizer.json"
        )
    tokens: list[str] = vocab["tokens"]
    merges = [tuple(m.split(" ", 1)) for m in vocab.get("merges", [])]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types: list[int] = vocab.get("token_type", [])
    whole = [t for t, kind in zip(tokens, types, strict=False) if kind in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in whole])
    return tok


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model file at ``path``."""
    with Path(path).open("rb") as f:
        return build_tokenizer(read_vocab(f))
