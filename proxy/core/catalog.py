"""Which backend serves which model, and each one's ``max_model_len``: routing by ``model``.

A request goes only to backends that serve its ``model``. What a backend serves comes from
its configured ``models``, else from its own ``GET /v1/models`` (read by the collector); a
backend whose list is not known yet (never read, unreadable) is "unknown" and is not ruled
out: the gateway cannot say it does not serve the model.

A model no known list names is answered 404 ``model_not_found`` (what vLLM answers), unless
some backend's list is unknown, or ``routing.unknown_model: pass_through`` is set (a
single-model fleet whose clients send arbitrary names: every backend may take it).

Pure data and rules, no I/O: the gateway builds a ``Catalog`` per request from its config
and the collector's cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BackendModels:
    """One backend's served models; ``ids`` None while its list is not known."""

    name: str
    ids: tuple[str, ...] | None
    # model id -> max_model_len (absent or None: not known)
    limits: Mapping[str, int | None] = field(default_factory=dict)

    def serves(self, model: str) -> bool | None:
        """True / False, or None when the list is not known."""
        return None if self.ids is None else model in self.ids

    def limit(self, model: str) -> int | None:
        return self.limits.get(model)


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where a request for one model may go: the backends ruled out, and the model's limit."""

    model: str
    # Backends that do not serve the model (or cannot hold this request: see ``too_small``).
    ruled_out: frozenset[str]
    # The largest known max_model_len over the backends that serve it (None: unknown).
    limit: int | None
    # True when no backend is known to serve it, yet it may pass (pass-through, unknown lists).
    passed_through: bool = False


@dataclass(frozen=True, slots=True)
class Catalog:
    backends: tuple[BackendModels, ...]

    def served_ids(self) -> list[str]:
        return sorted({m for b in self.backends for m in (b.ids or ())})

    def route(self, model: str, pass_through: bool) -> ModelRoute | None:
        """Where ``model`` may go; None when it is served nowhere (the caller answers 404)."""
        known = [b for b in self.backends if b.serves(model)]
        unknown = [b for b in self.backends if b.ids is None]
        if not known and not unknown and not pass_through:
            return None
        if not known:
            # Nobody lists it: pass-through sends it anywhere, else only where lists are unknown.
            allowed = {b.name for b in (self.backends if pass_through else unknown)}
            return ModelRoute(model, self._others(allowed), None, passed_through=True)
        allowed = {b.name for b in known + unknown}
        limits = [b.limit(model) for b in known]
        best = max((x for x in limits if x), default=None)
        return ModelRoute(model, self._others(allowed), best)

    def too_small(self, model: str, tokens: int) -> frozenset[str]:
        """Backends whose known limit for ``model`` is below ``tokens`` (prompt + max_tokens)."""
        return frozenset(
            b.name for b in self.backends if (lim := b.limit(model)) is not None and tokens > lim
        )

    def model_limit(self, model: str) -> int | None:
        """The largest known max_model_len of ``model`` over the fleet."""
        return max((lim for b in self.backends if (lim := b.limit(model))), default=None)

    def _others(self, allowed: set[str]) -> frozenset[str]:
        return frozenset(b.name for b in self.backends if b.name not in allowed)
