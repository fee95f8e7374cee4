"""``GET /v1/models`` for the whole fleet: every served model once, with its context limit.

Built from the catalog (configured ``models`` and each backend's own ``/v1/models``, cached
by the collector), so listing models costs no upstream call. Each entry is OpenAI's model
object plus vLLM's ``max_model_len`` (the largest over the backends that serve it: the
longest request the fleet accepts) and ``backends``, the names serving it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from proxy.backends.base import ModelsInfo
from proxy.backends.registry import adapter_for
from proxy.config import Config
from proxy.gateway.models import ModelsLookup, build_catalog


def lookup_from(models: Callable[[str], ModelsInfo | None]) -> ModelsLookup:
    """The collector's cache as the gateway reads it: model id -> max_model_len."""

    # The same (immutable) answer gives the same mapping: no dict built per request.
    seen: dict[str, tuple[ModelsInfo, Mapping[str, int | None]]] = {}

    def lookup(name: str) -> Mapping[str, int | None] | None:
        info = models(name)
        if info is None:
            return None
        hit = seen.get(name)
        if hit is None or hit[0] is not info:
            hit = seen[name] = (info, {m.id: m.max_model_len for m in info.models})
        return hit[1]

    return lookup


def kind_errors(kind: str, status: int, body: bytes) -> str | None:
    """A backend kind's own reading of an error answer (``Adapter.classify_error``)."""
    try:
        adapter = adapter_for(kind)
    except KeyError:
        return None
    return adapter.classify_error(status, body)


def fleet_models(cfg: Config, lookup: ModelsLookup, created: int) -> dict[str, Any] | None:
    """The list, or None while no backend's models are known (the caller asks them live)."""
    catalog = build_catalog(cfg, lookup)
    ids = catalog.served_ids()
    if not ids:
        return None
    data = [
        {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "kvroute",
            "max_model_len": catalog.model_limit(model),
            "backends": sorted(b.name for b in catalog.backends if b.serves(model)),
        }
        for model in ids
    ]
    return {"object": "list", "data": data}
