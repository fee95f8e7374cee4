"""The simulated engine's command line: ``kvroute engine`` and ``python -m loadtest.engine.server``.

Flags map one for one onto ``EngineConfig`` (the kvroute behaviour: allocation at admission,
503 on failure) or ``BehaviourConfig`` (``--behaviour vllm|sglang|tgi``: that server's paged,
lazily allocating, queueing behaviour and its own metric names).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from loadtest.engine.model import EngineConfig

if TYPE_CHECKING:
    from loadtest.engine.behaviours import BehaviourConfig

log = logging.getLogger("kvroute.engine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, for ``kvroute engine`` and ``python -m loadtest.engine.server``."""
    d = EngineConfig()
    add_server_arguments(parser, d)
    add_model_arguments(parser, d)
    add_behaviour_arguments(parser)
    add_scheduler_arguments(parser)
    parser.add_argument("--no-uvloop", action="store_true", help="use asyncio's default event loop")
    parser.add_argument("--log-level", default="warning", help="logging level (default warning)")


def add_server_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """Where it listens and what it calls itself."""
    parser.add_argument("--host", default=d.host, help=f"listen address (default {d.host})")
    parser.add_argument(
        "--port", type=int, default=d.port, help=f"listen port, 0 = any free (default {d.port})"
    )
    parser.add_argument(
        "--name", default=d.name, help="engine name, sent as the x-engine-name header"
    )


def add_model_arguments(parser: argparse.ArgumentParser, d: EngineConfig) -> None:
    """The model served, its KV cache and its simulated speed."""
    parser.add_argument("--model", default=d.model, help=f"model id served (default {d.model})")
    parser.add_argument(
        "--allocator",
        choices=("contiguous", "paged"),
        default=d.allocator,
        help="KV-cache allocator",
    )
    parser.add_argument(
        "--capacity-tokens",
        type=int,
        default=d.capacity_tokens,
        help=f"KV cache size (default {d.capacity_tokens})",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="paged allocator block size (default 16)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d.prefill_tokens_per_s,
        help="prompt processing rate",
    )
    parser.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=d.decode_tokens_per_s,
        help="output rate per request",
    )
    parser.add_argument(
        "--speedup", type=float, default=d.speedup, help="divide all simulated times by this"
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_max_tokens,
        help="max_tokens when a request omits it",
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for the generated text")
    parser.add_argument(
        "--chunk-interval-s",
        type=float,
        default=d.chunk_interval_s,
        help="min seconds between stream chunks",
    )
    parser.add_argument(
        "--strict-model", action="store_true", help="404 for a model other than --model"
    )


def add_behaviour_arguments(parser: argparse.ArgumentParser) -> None:
    """Which server it behaves like (vllm/sglang/tgi) and that behaviour's knobs."""
    parser.add_argument(
        "--behaviour",
        choices=("kvroute", "vllm", "sglang", "tgi"),
        default="kvroute",
        help="kvroute: allocate at admission, 503 on failure (default); vllm/sglang/tgi: that "
        "server's paged, lazily allocating, queueing behaviour and its own metric names",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="running requests per engine (vllm/sglang/tgi)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="per-request token limit, answered with the server's own 400 (default: the KV size)",
    )
    parser.add_argument(
        "--data-parallel", type=int, default=1, help="engines behind one port (vllm/sglang)"
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="vllm: turn off the automatic prefix cache (cached prompt blocks skip prefill)",
    )
    parser.add_argument(
        "--serial-prefill",
        action="store_true",
        help="vllm/sglang/tgi: prefill prompts one after another (one GPU's compute) "
        "instead of all at full speed at once",
    )
    parser.add_argument(
        "--tokenizer-ratio",
        type=float,
        default=1.0,
        help="vllm/sglang/tgi: count prompts as this many tokens per token of the gateway's "
        "default (cl100k) count, as a server with another tokenizer does (default 1.0)",
    )
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="vllm: publish KV-cache events as vLLM does, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/kv-events.md)',
    )
    # Imported here: importing this module alone does not load the behaviours (aiohttp).
    from loadtest.engine.behaviours import disaggregation

    disaggregation.add_arguments(parser)
    parser.add_argument(
        "--die-after-tokens",
        type=int,
        default=None,
        help="vllm/sglang/tgi: reset every stream's connection after this many tokens "
        "(mid-stream failures; POST /admin/fault sets one at run time)",
    )


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduler model (classic or vLLM v1's) and how streams are paced (vllm/sglang/tgi)."""
    parser.add_argument(
        "--scheduler",
        choices=("classic", "v1"),
        default="classic",
        help="vllm: classic (fixed decode steps, prefill beside them; the default) or v1 "
        "(vLLM v1's: a token budget per step, running first, chunked prefill, step time "
        "growing with the batch's tokens; docs/engine.md)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="v1: tokens scheduled per step, decodes and prefill chunks together (default 8192)",
    )
    parser.add_argument(
        "--step-base-ms",
        type=float,
        default=10.0,
        help="v1: a step's fixed time in ms before --speedup (default 10)",
    )
    parser.add_argument(
        "--step-per-token-us",
        type=float,
        default=None,
        help="v1: a step's time per scheduled token in us before --speedup "
        "(default 1e6 / --prefill-tokens-per-s: a full-budget prefill step runs at that rate)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="tokens per SSE event, as vLLM's --stream-interval (default 1 with --scheduler v1; "
        "classic: 0, all tokens new since the last flush in one event)",
    )
    parser.add_argument(
        "--flush-interval-s",
        type=float,
        default=0.0,
        help="vllm/sglang/tgi: flush a stream at most every this many wall seconds (default 0)",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        name=args.name,
        host=args.host,
        port=args.port,
        model=args.model,
        allocator=args.allocator,
        capacity_tokens=args.capacity_tokens,
        block_size=args.block_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        speedup=args.speedup,
        default_max_tokens=args.default_max_tokens,
        seed=args.seed,
        chunk_interval_s=args.chunk_interval_s,
        strict_model=args.strict_model,
        uvloop=not args.no_uvloop,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Entry for a CLI that built its parser with :func:`add_arguments`."""
    logging.basicConfig(
        level=str(args.log_level).upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "behaviour", "kvroute") != "kvroute":
        from loadtest.engine.behaviours import run as run_behaviour

        bconf = behaviour_config_from_args(args)
        log.info("starting engine %s", asdict(bconf))
        run_behaviour(bconf, args.host, args.port)
        return 0
    from loadtest.engine.serving import run

    config = config_from_args(args)
    log.info("starting engine %s", asdict(config))
    run(config)
    return 0


def behaviour_config_from_args(args: argparse.Namespace) -> BehaviourConfig:
    from loadtest.engine.behaviours import BehaviourConfig, disaggregation

    return BehaviourConfig(
        behaviour=args.behaviour,
        name=args.name,
        model=args.model,
        capacity_tokens=args.capacity_tokens,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        data_parallel=args.data_parallel,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_tokens_per_s=args.decode_tokens_per_s,
        speedup=args.speedup,
        seed=args.seed,
        prefix_caching=not getattr(args, "no_prefix_caching", False),
        serial_prefill=getattr(args, "serial_prefill", False),
        tokenizer_ratio=getattr(args, "tokenizer_ratio", 1.0),
        kv_events_config=getattr(args, "kv_events_config", None),
        pd=disaggregation.role_config_from_args(args),
        die_after_tokens=getattr(args, "die_after_tokens", None),
        scheduler=getattr(args, "scheduler", "classic"),
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", 8192),
        step_base_ms=getattr(args, "step_base_ms", 10.0),
        step_per_token_us=getattr(args, "step_per_token_us", None),
        stream_interval=getattr(args, "stream_interval", None),
        flush_interval_s=getattr(args, "flush_interval_s", 0.0),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvroute engine", description="Simulated inference engine with a fragmenting KV cache"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config_from_args(args)
        if args.behaviour != "kvroute":
            behaviour_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
