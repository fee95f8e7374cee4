"""Sizing benchmark: what counting a request costs, and how far cl100k is from a model's tokenizer.

Prints, all measured in one run (read the ratios; absolute times move with machine load):

1. sizing a 30k-token chat prompt (no cache), next to parsing its JSON;
2. turn 20 of a 20-turn chat with 20 tools: without the cache, with it (turns 1-19 sized
   before, as a gateway would have), and sizing the new message alone: with the cache, turn 20
   should cost about its new message;
3. tokens of the bundled trace's prompt lengths (texts of exactly that many cl100k tokens)
   counted by cl100k and by a model tokenizer: ``--tokenizer-file`` (a real ``tokenizer.json``)
   or, when none is given, a byte-level BPE that this script trains on the repository's own
   docs. That one is NOT a real model's tokenizer: it shows the machinery, not Llama's ratio.

    python -m loadtest.bench.sizing [--tokenizer-file PATH] [--trace-limit 500] [--repeat 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from loadtest.workload import load_trace, make_prompt
from proxy.core.demand import ModelSizing, Sizer
from proxy.core.tokenizer import HFCounter, TiktokenCounter, TokenCache
from proxy.core.validation import ParsedRequest, parse_request

ROOT = Path(__file__).resolve().parent.parent.parent
TRACE = ROOT / "loadtest" / "data" / "AzureLLMInferenceTrace_code.csv"


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _parsed(body: dict[str, Any]) -> ParsedRequest:
    return parse_request(orjson.dumps({"model": "m", **body}), "chat", 10**7)


def _sizer(cache_entries: int) -> Sizer:
    return Sizer(ModelSizing(TiktokenCounter()), cache=TokenCache(cache_entries))


def bench_30k(repeat: int) -> None:
    body = {"messages": [{"role": "user", "content": make_prompt(30_000)}], "max_tokens": 1}
    raw = orjson.dumps({"model": "m", **body})
    parsed = _parsed(body)
    sizer = _sizer(0)
    size_s = _median_s(lambda: sizer.size(parsed), repeat)
    parse_s = _median_s(lambda: parse_request(raw, "chat", 10**7), repeat)
    print("## 30k-token prompt (no cache)")
    print(f"sizing: {size_s * 1e3:.1f} ms ({30_000 / size_s / 1e6:.2f} M tokens/s)")
    print(f"parsing its JSON: {parse_s * 1e3:.2f} ms (sizing / parsing = {size_s / parse_s:.0f}x)")


def _chat(turns: int, rng: random.Random) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": make_prompt(300, rng)}]
    for _ in range(turns - 1):
        msgs.append({"role": "user", "content": make_prompt(300, rng)})
        msgs.append({"role": "assistant", "content": make_prompt(400, rng)})
    return msgs


def bench_turn_20(repeat: int) -> None:
    rng = random.Random(1)
    history = _chat(20, rng)
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": make_prompt(60, rng)}}
        for i in range(20)
    ]
    news = [
        {"role": "user", "content": make_prompt(300, random.Random(100 + i))} for i in range(repeat)
    ]
    cold = _sizer(0)
    warm = _sizer(16_384)
    # Turns 1-19 were sized before, as the gateway would have while the chat went on.
    for turn in range(1, 20):
        warm.size(_parsed({"messages": history[: 2 * turn], "tools": tools}))
    turn20 = [_parsed({"messages": [*history, m], "tools": tools}) for m in news]
    alone = [_parsed({"messages": [m]}) for m in news]
    it = iter(range(repeat * 3))

    def each(sizer: Sizer, reqs: list[ParsedRequest]) -> Callable[[], object]:
        return lambda: sizer.size(reqs[next(it) % repeat])

    no_cache = _median_s(each(cold, turn20), repeat)
    cached = _median_s(each(warm, turn20), repeat)
    new_only = _median_s(each(cold, alone), repeat)
    tokens = cold.size(turn20[0]).prompt_tokens
    print(
        f"## turn 20 of a 20-turn chat with 20 tools ({tokens} prompt tokens, a new 300-token message)"
    )
    print(f"without cache: {no_cache * 1e3:.2f} ms")
    print(f"with cache:    {cached * 1e3:.2f} ms ({no_cache / cached:.1f}x faster)")
    print(
        f"new message alone: {new_only * 1e3:.2f} ms (turn 20 cached / new message = {cached / new_only:.1f}x)"
    )


def _bpe_from_docs(path: Path) -> Path:
    """A byte-level BPE (vocab 4,000) trained on this repository's Markdown: not a real model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=4000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def bench_trace(tokenizer_file: Path | None, limit: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        label = str(tokenizer_file)
        if tokenizer_file is None:
            tokenizer_file = _bpe_from_docs(Path(tmp))
            label = "test-built byte-level BPE, vocab 4000, trained on this repo's docs (NOT a real model's)"
        model = HFCounter(tokenizer_file)
    cl = TiktokenCounter()
    reqs = load_trace(TRACE, limit=limit)
    rng = random.Random(7)
    ratios: list[float] = []
    total_cl = total_model = 0
    t0 = time.perf_counter()
    for r in reqs:
        text = make_prompt(r.prompt_tokens, rng)
        n_cl, n_model = cl.count(text), model.count(text)
        total_cl += n_cl
        total_model += n_model
        ratios.append(n_model / n_cl)
    q = statistics.quantiles(ratios, n=10)
    print(f"## bundled trace, first {len(reqs)} prompt lengths ({time.perf_counter() - t0:.1f} s)")
    print(f"model tokenizer: {label}")
    print(
        f"tokens: cl100k {total_cl:,}, model {total_model:,} (model / cl100k = {total_model / total_cl:.3f})"
    )
    print(
        f"per request model / cl100k: p10 {q[0]:.3f}, median {statistics.median(ratios):.3f}, p90 {q[-1]:.3f}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokenizer-file", type=Path, default=None, help="a real tokenizer.json")
    ap.add_argument("--trace-limit", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    bench_30k(args.repeat)
    bench_turn_20(args.repeat)
    bench_trace(args.tokenizer_file, args.trace_limit)


if __name__ == "__main__":
    main()
