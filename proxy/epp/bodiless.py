"""Requests without a body (``GET /v1/models``, a health probe): nothing to size or reserve.

The gateway's pool carries more than completions. A client listing models gets the fleet's
list as ``kvroute serve`` answers it (``proxy.api.model_listing``: the catalog the collector
keeps, every served model once with its ``max_model_len``), answered by Envoy itself; any
other body-less request goes to a backend that is up and not ejected, in turn, without a
reservation (it holds no KV cache). Nothing eligible: the gateway's 503.
"""

from __future__ import annotations

import itertools
import time

import orjson

from proxy.api.model_listing import fleet_models
from proxy.errors import ApiError
from proxy.gateway.walk import Gateway

MODELS_PATH = "/v1/models"


class Bodiless:
    """Where a body-less request goes, or what answers it."""

    def __init__(self) -> None:
        self._turn = itertools.count()
        self.started = int(time.time())

    def models(self, gw: Gateway) -> bytes | None:
        """The fleet's model list (None while no backend's models are known)."""
        listed = fleet_models(gw.cfg, gw.models_info, self.started)
        return orjson.dumps(listed) if listed is not None else None

    def backend(self, gw: Gateway, leave_out: frozenset[str]) -> str | None:
        """A backend up and not avoided, taken in turn (None: nothing eligible)."""
        avoid = gw.health.avoid() | leave_out
        eligible = [b.name for b in gw.cfg.backends if b.name not in avoid]
        if not eligible:
            return None
        return eligible[next(self._turn) % len(eligible)]

    @staticmethod
    def unavailable() -> ApiError:
        return ApiError(
            503,
            "no backend is available for this request",
            type="service_unavailable",
            code="no_backend_available",
        )
