"""The backend kind -> its adapter (``proxy.backends.base.Adapter``)."""

from __future__ import annotations

from proxy.backends.base import Adapter
from proxy.backends.kvroute import KvrouteAdapter
from proxy.backends.llamacpp import LlamacppAdapter
from proxy.backends.sglang import SglangAdapter
from proxy.backends.tgi import TgiAdapter
from proxy.backends.vllm import PagedAdapter, VllmAdapter

_ADAPTERS: dict[str, Adapter] = {
    "contiguous": KvrouteAdapter("contiguous"),
    "paged": PagedAdapter(),
    "vllm": VllmAdapter(),
    "sglang": SglangAdapter(),
    "tgi": TgiAdapter(),
    "llamacpp": LlamacppAdapter(),
}


def adapter_for(kind: str) -> Adapter:
    """The adapter for a configured ``kind``; ``KeyError`` for a kind config.py does not allow."""
    return _ADAPTERS[kind]


def kinds() -> tuple[str, ...]:
    return tuple(_ADAPTERS)
