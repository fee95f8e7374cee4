"""Backend names as the gateway knows them, ``ip:port`` as Envoy routes to them.

Envoy's ``ORIGINAL_DST`` cluster connects to the address in ``x-gateway-destination-endpoint``
as given, so a backend's URL must hold an address, not a name to resolve (discovery from an
EndpointSlice or an InferencePool gives pod IPs).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from proxy.config import Config
from proxy.epp.messages import LB_NAMESPACE, SERVED, SUBSET_KEY, SUBSET_NAMESPACE


def address_of(url: str) -> str:
    """``http://10.0.0.5:8000/v1`` -> ``10.0.0.5:8000`` (IPv6 kept in brackets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}"


class Endpoints:
    """Both directions of the name <-> address map, for the config in force."""

    def __init__(self, cfg: Config) -> None:
        self.address = {b.name: address_of(b.plain_url) for b in cfg.backends}
        self.name = {addr: name for name, addr in self.address.items()}

    def names_outside(self, subset: Iterable[str]) -> frozenset[str]:
        """The backends the subset hint leaves out (every one when none is in it)."""
        allowed = {self.name[a] for a in subset if a in self.name}
        return frozenset(self.address) - allowed


def _strings(value: struct_pb2.Value) -> list[str]:
    """A metadata value as a list of endpoints: a list of strings or one comma-separated string."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value.strip() for v in value.list_value.values if v.string_value.strip()]
    if kind == "string_value":
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The proxy's subset hint, or None when it sent none (every backend may be picked)."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    return _strings(fields[SUBSET_KEY])


def served_endpoint(request: pb.ProcessingRequest) -> str | None:
    """The endpoint the gateway says it served from (``envoy.lb`` in the metadata), if it says."""
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE not in namespaces or SERVED not in namespaces[LB_NAMESPACE].fields:
        return None
    served = _strings(namespaces[LB_NAMESPACE].fields[SERVED])
    return served[0] if served else None
