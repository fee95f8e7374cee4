"""Size a request without freezing the event loop.

Counting is pure (``proxy.core.demand``); this module decides where it runs. The decision
is by the total characters of everything that will be tokenized or hashed (names, tool
definitions, tool-call arguments, content parts, prompts), with each field's share capped
at ``sizing.max_field_chars`` because a longer field is sized by its byte length, not
tokenized. Deciding by ``content`` alone let a 3.9 MB ``name`` hold ``/health`` for 2.2 s.
Both tokenizers release the GIL while encoding in a worker thread (see
``proxy.core.tokenizer``), so the loop keeps serving while a big prompt is counted.

With prefix affinity on, the same call (inline, or the same worker-thread hop) also hashes
the prompt's token blocks from the ids the count was taken from: one encode and one hop per
request, not two of each. The hashes wait for ``proxy.gateway.affinity`` (``take_hashes``)
under a weak reference to the parsed request, so an abandoned request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import weakref
from typing import Any

from proxy.config import Config, PrefixConfig
from proxy.core.demand import Demand, Sizer
from proxy.core.prefix_prompt import IdsCache, prompt_hashes
from proxy.core.tokenizer import TiktokenCounter, TokenCache
from proxy.core.tokens import PromptCounter, SizingRules, work_chars
from proxy.core.validation import ParsedRequest

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

    The first time on a loop, also start the worker threads big requests are sized in.
    """
    sizer = await asyncio.to_thread(sizer_for, cfg)
    loop = asyncio.get_running_loop()
    if loop not in _warmed:
        _warmed.add(loop)
        await warm_threads()
    return sizer


# Loops whose default executor already runs all its threads.
_warmed: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


async def warm_threads(n: int | None = None, timeout_s: float = 0.5) -> None:
    """Start the loop's default executor's ``n`` threads now (default: all it may start).

    ``ThreadPoolExecutor`` starts a thread on a submit that finds none idle, and
    ``Thread.start()`` waits, on the event loop, for the new thread to run: on a busy box
    that stalled the loop 3 ms and more per start during the first concurrent big requests.
    """
    n = min(32, (os.cpu_count() or 1) + 4) if n is None else n
    # Each call waits for all the others, so n distinct threads must be running at once.
    barrier = threading.Barrier(n)

    def meet() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout_s)

    await asyncio.gather(*(asyncio.to_thread(meet) for _ in range(n)))


def _loaded(cfg: Config) -> Sizer | None:
    with _lock:
        hit = _sizers.get(id(cfg))
        return hit[1] if hit is not None and hit[0] is cfg else None


async def size_request(
    parsed: ParsedRequest, cfg: Config, max_model_len: int | None = None
) -> Demand:
    """The request's KV demand, counted inline when small and in a worker thread otherwise."""
    sizer = _loaded(cfg) or await load_sizer(cfg)
    prefix = cfg.routing.prefix
    if sizer.work_chars(parsed) <= cfg.routing.tokenize_in_thread_chars:
        demand, hashes = _size(sizer, parsed, prefix, max_model_len)
    else:
        demand, hashes = await asyncio.to_thread(
            _size_in_worker, sizer, parsed, prefix, max_model_len
        )
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
    sizer: Sizer, parsed: ParsedRequest, spec: HashSpec, cache: IdsCache | None = None
) -> tuple[int, ...]:
    """The prompt's block hashes; its ids come from the sizer's ids cache where counted."""
    encode = getattr(sizer.model(parsed.model).counter, "ids", None)
    if encode is None:
        return ()
    encoder, max_tokens, block_tokens = spec
    ids = cache if cache is not None else sizer.ids
    return prompt_hashes(parsed.body, encoder, encode, max_tokens, block_tokens, ids)


def _size(
    sizer: Sizer, parsed: ParsedRequest, prefix: PrefixConfig, max_model_len: int | None
) -> tuple[Demand, tuple[HashSpec, tuple[int, ...]] | None]:
    demand = sizer.size(parsed, max_model_len)
    spec = hash_spec(sizer, parsed, prefix)
    return demand, None if spec is None else (spec, prefix_hashes(sizer, parsed, spec))


#: Linux nice of the worker threads big requests are sized in, above the event loop's 0.
WORKER_NICE = 10
_niced = threading.local()


def _size_in_worker(
    sizer: Sizer, parsed: ParsedRequest, prefix: PrefixConfig, max_model_len: int | None
) -> tuple[Demand, tuple[HashSpec, tuple[int, ...]] | None]:
    """``_size`` in a worker thread that yields the CPU to the event loop's thread.

    Encoding a 30k-token prompt is ~5 ms of CPU with the GIL released; with a few at once
    on a small box, the loop's thread waited for a core behind them (issue 12: loop lag
    p50 1.3 ms -> 0.15 ms with the workers at nice 10, same run). The workers hold the GIL
    only for short steps now (ids arrive as a buffer, the block hashes are vectorized), so
    a lowered worker rarely keeps the loop waiting for the GIL. The thread stays lowered
    for whatever else the loop's default executor runs in it later (all of it background
    work next to the loop's).
    """
    if not getattr(_niced, "done", False):
        _niced.done = True
        # Linux only: there a thread id names one thread; elsewhere it would be a process.
        if sys.platform == "linux":
            with contextlib.suppress(OSError):
                tid = threading.get_native_id()
                os.setpriority(
                    os.PRIO_PROCESS, tid, max(WORKER_NICE, os.getpriority(os.PRIO_PROCESS, tid))
                )
    return _size(sizer, parsed, prefix, max_model_len)


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
