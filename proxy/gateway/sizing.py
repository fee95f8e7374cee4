"""Size a request without freezing the event loop.

Counting is pure (``proxy.core.demand``); this module decides where it runs. The decision
is by the total characters of everything that will be tokenized or hashed (names, tool
definitions, tool-call arguments, content parts, prompts), with each field's share capped
at ``sizing.max_field_chars`` because a longer field is sized by its byte length, not
tokenized. Deciding by ``content`` alone let a 3.9 MB ``name`` hold ``/health`` for 2.2 s.
Both tokenizers release the GIL while encoding in a worker thread (see
``proxy.core.tokenizer``), so the loop keeps serving while a big prompt is counted. Those
threads are a few of their own, lowered, each with its own tokenizer copies
(``proxy.gateway.sizing_pool``).

With prefix affinity on, the same call (inline, or the same worker-thread hop) also hashes
the prompt's token blocks from the ids the count was taken from: one encode and one hop per
request, not two of each. The hashes wait for ``proxy.gateway.affinity`` (``take_hashes``)
under a weak reference to the parsed request, so an abandoned request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from proxy.config import Config, PrefixConfig
from proxy.core import chunk_count, digest
from proxy.core.chunk_count import EncodeJob
from proxy.core.chunked_counter import ChunkedCounter
from proxy.core.demand import Demand, Sizer
from proxy.core.prefix_prompt import PiecesCache, prompt_hashes, text_pieces
from proxy.core.tokenizer import TiktokenCounter, TokenCache
from proxy.core.tokens import PromptCounter, SizingRules, work_chars
from proxy.core.validation import ParsedRequest
from proxy.gateway import encode_once, sizing_pool
from proxy.gateway.sizing_pool import WORKER_NICE as WORKER_NICE

_lock = threading.Lock()
# id(cfg) -> (cfg, sizer): the config is kept so that its id cannot be reused by another.
_sizers: dict[int, tuple[Config, Sizer]] = {}
_KEEP_SIZERS = 8


def sizer_for(cfg: Config) -> Sizer:
    """The Sizer of this config, built once (loading tokenizers takes ~0.4 s: off the loop)."""
    with _lock:
        hit = _sizers.get(id(cfg))
        if hit is None or hit[0] is not cfg:
            hit = (cfg, Sizer.from_config(cfg))
            _sizers[id(cfg)] = hit
            # A process sees one config, tests a few dozen: keep the newest few.
            while len(_sizers) > _KEEP_SIZERS:
                del _sizers[next(iter(_sizers))]
        return hit[1]


async def load_sizer(cfg: Config) -> Sizer:
    """Build the config's Sizer in a worker thread (at startup, before the first request).

    The first time for a Sizer, also start the sizing threads and build their own copies of
    its encodings (``proxy.gateway.sizing_pool``), so the first big requests wait for neither.
    """
    sizer = await asyncio.to_thread(sizer_for, cfg)
    sizing_pool.configure(cfg.sizing.threads)
    pool = sizing_pool.executor()
    if _warmed.get(sizer) is not pool:
        _warmed[sizer] = pool
        await sizing_pool.warm(functools.partial(_touch_encoders, sizer))
    return sizer


# Sizer -> the sizing pool whose every thread has built (and warmed) its encoders.
_warmed: weakref.WeakKeyDictionary[Sizer, ThreadPoolExecutor] = weakref.WeakKeyDictionary()


def _touch_encoders(sizer: Sizer) -> None:
    # One tiny encode per model builds (and warms) this thread's copy of its encoding.
    for m in [sizer.default, *sizer.models.values()]:
        m.counter.count("warm up")


def loaded(cfg: Config) -> Sizer | None:
    """The config's Sizer if it is built already (never builds it: that is slow)."""
    with _lock:
        hit = _sizers.get(id(cfg))
        return hit[1] if hit is not None and hit[0] is cfg else None


_loaded = loaded


def chars_to_count(sizer: Sizer, parsed: ParsedRequest, inline: int) -> int:
    """What decides inline or threaded counting (``Sizer.work_chars``), for a body of more
    than ``inline`` bytes.

    Walking every field of the body for it cost a tiny request more than its own count
    (docs/benchmarks.md, section 9). A body of at most ``inline`` bytes is counted inline
    whatever its fields hold, so its length stands for the walk.
    """
    if len(parsed.raw) <= inline:
        return len(parsed.raw)
    return sizer.work_chars(parsed)


async def size_request(
    parsed: ParsedRequest,
    cfg: Config,
    max_model_len: int | None = None,
    job: EncodeJob | None = None,
    chars: int | None = None,
) -> Demand:
    """The request's KV demand, counted inline when small and in a sizing thread otherwise.

    ``job``: the new chunks ``size_from_caches`` found, encoded first (not looked up again).
    ``chars``: ``chars_to_count`` of ``parsed`` when the caller has it already.
    """
    sizer = _loaded(cfg) or await load_sizer(cfg)
    prefix = cfg.routing.prefix
    inline = cfg.routing.tokenize_in_thread_chars
    if (chars if chars is not None else chars_to_count(sizer, parsed, inline)) <= inline:
        demand, hashes = _size(sizer, parsed, prefix, max_model_len)
    else:
        demand, hashes = await _size_big(sizer, parsed, prefix, max_model_len, inline, job)
    if hashes is not None:
        _keep(parsed, *hashes)
    return demand


#: What a prompt's block hashes depend on: the tokenizer, the ids hashed, the block size.
HashSpec = tuple[str, int, int]


def hash_spec(sizer: Sizer, parsed: ParsedRequest, prefix: PrefixConfig) -> HashSpec | None:
    """The spec of ``parsed``'s prefix hashes; None when there are none to compute."""
    counter = sizer.model(parsed.model).counter
    if not prefix.enabled or prefix.max_prompt_tokens <= 0 or not hasattr(counter, "ids"):
        return None
    return counter.id, prefix.max_prompt_tokens, prefix.block_tokens


def prefix_hashes(
    sizer: Sizer, parsed: ParsedRequest, spec: HashSpec, cache: PiecesCache | None = None
) -> tuple[int, ...]:
    """The prompt's block hashes; its pieces come from the sizer's pieces cache where counted."""
    encode = text_pieces(sizer.model(parsed.model).counter)
    if encode is None:
        return ()
    encoder, max_tokens, block_tokens = spec
    pieces = cache if cache is not None else sizer.pieces
    return prompt_hashes(parsed.body, encoder, encode, max_tokens, block_tokens, pieces)


def _size(
    sizer: Sizer, parsed: ParsedRequest, prefix: PrefixConfig, max_model_len: int | None
) -> tuple[Demand, tuple[HashSpec, tuple[int, ...]] | None]:
    # Each text is digested once for all the cache keys of this call (count, ids, hashes).
    with digest.memo():
        demand = sizer.size(parsed, max_model_len)
        spec = hash_spec(sizer, parsed, prefix)
        return demand, None if spec is None else (spec, prefix_hashes(sizer, parsed, spec))


Sized = tuple[Demand, tuple["HashSpec", tuple[int, ...]] | None]
#: Rounds of "encode the new chunks in a thread, size again on the loop" before giving up.
_ENCODE_ROUNDS = 4


async def _size_big(
    sizer: Sizer,
    parsed: ParsedRequest,
    prefix: PrefixConfig,
    max_model_len: int | None,
    inline_bytes: int,
    job: EncodeJob | None = None,
) -> Sized:
    """A big request: on the loop from the caches, a thread encoding only what is new.

    A prompt seen before (a document behind a new question, a chat's history) costs ~1 ms
    of CPU from the chunk cache (``proxy.core.chunk_count``), less than a hop to a sizing
    thread costs under load: there every numpy call and encode retakes the GIL behind the
    busy event loop (up to the 5 ms switch interval each). New text is encoded in a sizing
    thread (one encode per run of new chunks, nothing else), then sized here from the cache.
    Any other shape (a tokenizer that cannot be cut, a split that fails) is sized whole in
    the thread, as before.
    """
    if isinstance(sizer.model(parsed.model).counter, ChunkedCounter):
        encoded = False
        for _ in range(_ENCODE_ROUNDS):
            if job is not None:
                if not await encode_once.encode(job):
                    break
                encoded = True
            try:
                with chunk_count.inline_budget(inline_bytes):
                    got = _size(sizer, parsed, prefix, max_model_len)
                SIZED_WHERE["encoded" if encoded else "cache"] += 1
                return got
            except chunk_count.TooMuchToEncode as more:
                job = more.job
            if job is None:
                break
    SIZED_WHERE["thread"] += 1
    return await sizing_pool.run(_size, sizer, parsed, prefix, max_model_len)


def size_from_caches(
    parsed: ParsedRequest, cfg: Config, max_model_len: int | None
) -> Demand | EncodeJob | None:
    """A big request sized on the loop from the caches alone, else the job of what is new.

    The first step of ``_size_big``, for ``proxy.gateway.bound_route``, which decides what
    to do with a request that has much new text before its exact count is in (and hands
    the job back to ``size_request``). None: not a request the chunk cache sizes.
    """
    sizer = _loaded(cfg)
    if sizer is None or not isinstance(sizer.model(parsed.model).counter, ChunkedCounter):
        return None
    try:
        with chunk_count.inline_budget(cfg.routing.tokenize_in_thread_chars):
            demand, hashes = _size(sizer, parsed, cfg.routing.prefix, max_model_len)
    except chunk_count.TooMuchToEncode as more:
        return more.job
    SIZED_WHERE["cache"] += 1
    if hashes is not None:
        _keep(parsed, *hashes)
    return demand


#: Big requests: sized from the caches alone, after encoding new chunks, whole in a thread, or
#: routed on an upper bound while counted (``proxy.gateway.bound_route``).
SIZED_WHERE = {"cache": 0, "encoded": 0, "thread": 0, "bound": 0}


# id(parsed) -> (weak reference to it, spec, hashes), until affinity takes them or it dies.
_hashes: dict[int, tuple[weakref.ref[ParsedRequest], HashSpec, tuple[int, ...]]] = {}


def _keep(parsed: ParsedRequest, spec: HashSpec, hashes: tuple[int, ...]) -> None:
    key = id(parsed)

    def gone(ref: weakref.ref[ParsedRequest]) -> None:
        # Only this request's entry: its id may be reused once it is gone.
        hit = _hashes.get(key)
        if hit is not None and hit[0] is ref:
            del _hashes[key]

    _hashes[key] = (weakref.ref(parsed, gone), spec, hashes)


def take_hashes(parsed: ParsedRequest, spec: HashSpec) -> tuple[int, ...] | None:
    """The block hashes sizing computed for ``parsed`` with ``spec``; None if it did not."""
    hit = _hashes.pop(id(parsed), None)
    if hit is None or hit[0]() is not parsed or hit[1] != spec:
        return None
    return hit[2]


_DEFAULT_RULES = SizingRules()
_default_counter: PromptCounter | None = None


def _default() -> PromptCounter:
    global _default_counter
    if _default_counter is None:
        _default_counter = PromptCounter(TiktokenCounter(), _DEFAULT_RULES, TokenCache())
    return _default_counter


def count_prompt(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat or completions body with the default tokenizer and rules."""
    pc = _default()
    return pc.chat(body) if "messages" in body else sum(pc.prompts(body))


async def count_prompt_async(body: dict[str, Any], thread_above_chars: int = 4096) -> int:
    """``count_prompt`` off the loop when the body has more than ``thread_above_chars`` to count."""
    if work_chars(body, _DEFAULT_RULES) <= thread_above_chars:
        return count_prompt(body)
    return await asyncio.to_thread(count_prompt, body)
