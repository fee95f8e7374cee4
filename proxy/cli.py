"""The `kvroute` command: serve, engine, check-config, demo, simulate, tune.

Subcommands that live in `loadtest` are imported lazily so that `kvroute serve` starts
without loading the simulator or matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.api.app import create_app
    from proxy.api.logs import setup_logging
    from proxy.api.server import server_config
    from proxy.api.workers import refusal, reuse_port_socket, supervise
    from proxy.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    host = args.host or cfg.listen.host
    port = args.port if args.port is not None else cfg.listen.port
    why = refusal(cfg, args.workers)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    if args.workers > 1:
        # N processes on one port (proxy.api.workers); this one only supervises them.
        return supervise(sys.argv[1:] if args.argv is None else args.argv, args.workers)
    setup_logging(args.log_level, args.log_format)
    server_cfg = server_config(
        create_app(cfg),
        cfg,
        host,
        port,
        loop="uvloop",
        log_level=args.log_level,
        log_config=None,  # keep our handlers
        backlog=4096,
        timeout_graceful_shutdown=30,
    )
    sockets = [reuse_port_socket(host, port)] if args.reuse_port else None
    uvicorn.Server(server_cfg).run(sockets=sockets)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from proxy.config import ConfigError, load_config

    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    store = cfg.store.redis_url or "embedded (in-process)"
    if cfg.store.sentinel is not None:
        store = f"sentinel master {cfg.store.sentinel.master!r}"
    pools = ", ".join(f"{p}({cfg.pools[p].role})" for p in cfg.pools)
    found = "" if cfg.discovery.type == "static" else f" + {cfg.discovery.type} discovery"
    print(
        f"{args.file}: OK: {len(cfg.backends)} backends{found}, pools {pools}, policy {cfg.routing.policy}, store {store}"
    )
    return 0


def _delegate(module: str, func: str = "main") -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        target = getattr(importlib.import_module(module), func)
        result = target(args.rest)
        return int(result or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute", description="Fragmentation-aware gateway for LLM inference fleets"
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", required=True, help="YAML config file (see config/kvroute.yaml)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one object per line"
    )
    s.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes on this port (SO_REUSEPORT); more than one needs Redis",
    )
    s.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=_serve, argv=None)

    c = sub.add_parser("check-config", help="validate a config file and print what is wrong")
    c.add_argument("file")
    c.set_defaults(func=_check_config)

    for name, help_ in (
        ("engine", "run a simulated inference engine whose KV cache fragments"),
        ("demo", "run the demo: engines + gateway + the problem statement's workload"),
        ("simulate", "simulate a fleet over days of uptime, per routing policy"),
        ("tune", "search config knobs in simulation and recommend values"),
    ):
        sub.add_parser(name, help=help_, add_help=False)
    return p


_DELEGATED = {
    "engine": "loadtest.engine.server",
    "demo": "loadtest.demo",
    "simulate": "loadtest.sim.simulator",
    "tune": "loadtest.sim.tune",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        # Hand everything after the subcommand to its own parser (its own --help too).
        ns = argparse.Namespace(rest=argv[1:])
        return _delegate(_DELEGATED[argv[0]])(ns)
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        # The workers of `serve --workers N` are started with this same command line.
        args.argv = argv
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
