"""The `kvroute` command: serve, epp, engine, check-config, demo, simulate, tune.

Subcommands that live in `loadtest` are imported lazily so that `kvroute serve` starts
without loading the simulator or matplotlib.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.config import Config


def _serve(args: argparse.Namespace) -> int:
    from proxy.api.hangup import hup_reloads
    from proxy.api.workers import refusal, supervise
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
    # Bind before anything starts, so a busy port is one clear line and exit 1, never a
    # "gateway ready" followed by uvicorn's bind error. Workers share the port (SO_REUSEPORT).
    try:
        sock = _bind(host, port, reuse_port=args.reuse_port or args.workers > 1)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(
                f"kvroute serve: port {port} is in use on {host}; pick another with --port",
                file=sys.stderr,
            )
        else:
            print(f"kvroute serve: cannot listen on {host}:{port}: {exc.strerror}", file=sys.stderr)
        return 1
    if args.drain_s is not None and not args.drain_s > 0:
        print(f"kvroute serve: --drain-s {args.drain_s:g}: must be more than 0", file=sys.stderr)
        return 2
    reloads = hup_reloads(args.reload_on_hup)
    drain_s = args.drain_s if args.drain_s is not None else cfg.shutdown.drain_s
    if args.workers > 1:
        # N processes on one port (proxy.api.workers); this one only supervises them. Its
        # socket only proved the port free: never listening, it would take no connection,
        # but the workers bind their own.
        sock.close()
        argv = sys.argv[1:] if args.argv is None else args.argv
        return supervise(argv, args.workers, reloads, drain_s)
    _run_server(args, cfg, host, sock, reloads)
    return 0


def _run_server(
    args: argparse.Namespace, cfg: Config, host: str, sock: socket.socket, reloads: bool
) -> None:
    """One gateway process: the app, kvroute's server (drain on SIGTERM), SIGHUP's meaning."""
    import os
    import signal

    from proxy.api.app import create_app
    from proxy.api.drain import DrainingServer
    from proxy.api.logs import setup_logging
    from proxy.api.server import server_config
    from proxy.api.worker_peers import WORKER_DIR_ENV, WorkerPeers, bind_worker_socket

    setup_logging(args.log_level, args.log_format)
    log_listen(host, sock)
    app = create_app(cfg, config_path=args.config, freeze_heap=True, reload_on_hup=reloads)
    if args.drain_s is not None:
        app.state.drain.drain_s = lambda: float(args.drain_s)
    sockets = [sock]
    worker_dir = os.environ.get(WORKER_DIR_ENV)
    if worker_dir:
        # A worker of `serve --workers N`: its own socket, for reloads passed between workers.
        own = bind_worker_socket(worker_dir)
        sockets.append(own)
        app.state.worker_peers = WorkerPeers(worker_dir, own.getsockname())
    server_cfg = server_config(
        app,
        cfg,
        host,
        sock.getsockname()[1],
        loop="uvloop",
        log_level=args.log_level,
        log_config=None,  # keep our handlers
        backlog=4096,
    )
    server = DrainingServer(server_cfg, app.state.drain)
    if not reloads:
        # The terminal hung up: stop as on SIGTERM (proxy.api.hangup).
        signal.signal(signal.SIGHUP, server.handle_exit)
    server.run(sockets=sockets)


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket uvicorn would create (SO_REUSEADDR as uvicorn sets it);
    ``reuse_port``: other processes may bind it too and the kernel spreads connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def log_listen(host: str, sock: socket.socket) -> None:
    import logging

    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    logging.getLogger("kvroute.app").info("bound to http://%s:%d; starting", shown, port)


def _check_config(args: argparse.Namespace) -> int:
    from proxy.config import ConfigError, load_config
    from proxy.config_errors import redact_url

    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    store = redact_url(cfg.store.redis_url) if cfg.store.redis_url else "embedded (in-process)"
    if cfg.store.sentinel is not None:
        store = f"sentinel master {cfg.store.sentinel.master!r}"
    pools = ", ".join(f"{p}({cfg.pools[p].role})" for p in cfg.pools)
    found = "" if cfg.discovery.type == "static" else f" + {cfg.discovery.type} discovery"
    from proxy.config.tokenizer_check import tokenizer_warnings

    for warning in tokenizer_warnings(cfg):
        print(warning, file=sys.stderr)
    print(
        f"{args.file}: OK: {len(cfg.backends)} backend{'' if len(cfg.backends) == 1 else 's'}{found}, pools {pools}, policy {cfg.routing.policy}, store {store}"
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
    _add_serve(sub.add_parser("serve", help="run the gateway"))

    c = sub.add_parser("check-config", help="validate a config file and print what is wrong")
    c.add_argument("file")
    c.set_defaults(func=_check_config)

    for name, help_ in (
        ("engine", "run a simulated inference engine whose KV cache fragments"),
        (
            "demo",
            "run the demo: engines + gateway + a 70%% chat / 30%% document workload, vs round robin",
        ),
        ("local-fleet", "start the simulated engines a config file expects (one per backend)"),
        ("epp", "run the endpoint picker (Envoy ext_proc) of a Kubernetes inference gateway"),
        ("simulate", "simulate a fleet over days of uptime, per routing policy"),
        ("tune", "search config knobs in simulation and recommend values"),
    ):
        sub.add_parser(name, help=help_, add_help=False)
    return p


def _add_serve(s: argparse.ArgumentParser) -> None:
    """The options of ``kvroute serve``."""
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
    s.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help="on SIGTERM, let requests in flight finish for this long (default: shutdown.drain_s, 600)",
    )
    hup = s.add_mutually_exclusive_group()
    hup.add_argument(
        "--reload-on-hup",
        dest="reload_on_hup",
        action="store_const",
        const=True,
        default=None,
        help="SIGHUP reloads the config (default when not on a terminal)",
    )
    hup.add_argument(
        "--stop-on-hup",
        dest="reload_on_hup",
        action="store_const",
        const=False,
        help="SIGHUP stops the gateway (default in the foreground of a terminal)",
    )
    s.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    s.set_defaults(func=_serve, argv=None)


_DELEGATED = {
    "engine": "loadtest.engine.server",
    "demo": "loadtest.demo",
    "local-fleet": "loadtest.local_fleet",
    "epp": "proxy.epp.main",
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
