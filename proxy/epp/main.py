"""``kvroute epp``: the gateway app with the endpoint picker's gRPC servers beside it.

One process serves three ports: ext_proc (9002) and gRPC health (9003) for the inference
gateway, and the gateway's own HTTP port (``listen.port``) for ``/metrics``, ``/fleet``,
``/admin`` and ``/ready``. The HTTP port also keeps answering inference requests itself, so
one deployment can serve clients of both doors with one fleet view and one set of
reservations.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.config import Config

_EXTRA = "the endpoint picker needs its extra: pip install 'kvroute[epp]'"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute epp",
        description="run kvroute as the endpoint picker (Envoy ext_proc) of an inference gateway",
    )
    p.add_argument("--config", required=True, help="YAML config file (see config/kvroute.yaml)")
    p.add_argument("--host", default=None, help="HTTP host (default: listen.host)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: listen.port)")
    p.add_argument("--grpc-host", default="0.0.0.0", help="host of the two gRPC servers")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc port (default 9002)")
    p.add_argument("--health-port", type=int, default=9003, help="gRPC health port (default 9003)")
    p.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="on shutdown, how long open streams may finish (default 30)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
        from grpc_health.v1 import health  # noqa: F401
    except ImportError:
        print(_EXTRA, file=sys.stderr)
        return 2
    from proxy.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    _run(args, cfg)
    return 0


def _run(args: argparse.Namespace, cfg: Config) -> None:
    """The app with the EPP attached, on kvroute's server (drain on SIGTERM)."""
    from proxy.api.app import create_app
    from proxy.api.drain import DrainingServer
    from proxy.api.logs import setup_logging
    from proxy.api.server import server_config
    from proxy.epp.server import EppOptions, attach

    setup_logging(args.log_level, args.log_format)
    app = create_app(cfg, config_path=args.config, freeze_heap=True)
    options = EppOptions(args.grpc_host, args.grpc_port, args.health_port, args.grace_s)
    attach(app, options)
    host = args.host or cfg.listen.host
    port = args.port if args.port is not None else cfg.listen.port
    server_cfg = server_config(
        app, cfg, host, port, loop="uvloop", log_level=args.log_level, log_config=None
    )
    DrainingServer(server_cfg, app.state.drain).run()


if __name__ == "__main__":
    sys.exit(main())
