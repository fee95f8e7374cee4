"""Step 1b of the walk: which backends may take this ``model``, and its context limit.

The catalog (``proxy.core.catalog``) is built from the config's ``models`` per backend and
what each backend's ``GET /v1/models`` last said (the collector's cache, refreshed every
``collector.models_refresh_s``). A model served nowhere is a 404 ``model_not_found`` listing
what is served; a request longer than the model's ``max_model_len`` on every backend that
serves it is vLLM's own 400, before any state is touched; backends whose limit is too small
for this request are ruled out of its routing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from proxy.config import Config
from proxy.core.catalog import BackendModels, Catalog, ModelRoute
from proxy.core.model_limits import LimitError, context_length_error, model_not_found
from proxy.core.validation import ParsedRequest
from proxy.errors import ApiError

# Backend name -> what its /v1/models listed (model id -> max_model_len), None while unknown.
# The app wires it to the collector's cache (gateway code does not import the adapters).
ModelsLookup = Callable[[str], "Mapping[str, int | None] | None"]
# (backend kind, status, body) -> "allocation" | "overload" | "client_error" | "server_error",
# or None when no adapter reads that kind.
KindErrors = Callable[[str, int, bytes], "str | None"]


def build_catalog(cfg: Config, lookup: ModelsLookup) -> Catalog:
    """Config ``models`` win; else the backend's own list; ``models.<id>.max_model_len`` fills gaps."""
    out: list[BackendModels] = []
    for b in cfg.backends:
        info = lookup(b.name)
        ids: tuple[str, ...] | None = b.models or (tuple(info) if info is not None else None)
        limits: dict[str, int | None] = {}
        for model in ids or ():
            found = info.get(model) if info is not None else None
            conf = cfg.models.get(model)
            limits[model] = found if found is not None else (conf.max_model_len if conf else None)
        out.append(BackendModels(b.name, ids, limits))
    return Catalog(tuple(out))


class CatalogCache:
    """The catalog, built again only when the config or a backend's model list changed.

    Built per request it cost two catalog builds per request (the route, then the length
    check); here a request compares each backend's current list with the one the catalog
    was built from (copies: a list changed in place is still seen as changed).
    """

    # Routes remembered per catalog (model names come from clients: bounded).
    MAX_ROUTES = 256

    def __init__(self) -> None:
        self._cfg: Config | None = None
        self._lists: tuple[dict[str, int | None] | None, ...] = ()
        self._catalog: Catalog | None = None
        self._routes: dict[tuple[str, bool], ModelRoute | None] = {}

    def get(self, cfg: Config, lookup: ModelsLookup) -> Catalog:
        lists = tuple(lookup(b.name) for b in cfg.backends)
        if cfg is not self._cfg or self._catalog is None or lists != self._lists:
            self._catalog = build_catalog(cfg, lookup)
            self._cfg = cfg
            self._lists = tuple(dict(m) if m is not None else None for m in lists)
            self._routes.clear()
        return self._catalog

    def route(self, cfg: Config, lookup: ModelsLookup, model: str) -> ModelRoute | None:
        """``Catalog.route`` for ``model`` under ``cfg``, computed once per catalog."""
        return self.route_in(self.get(cfg, lookup), cfg, model)

    def route_in(self, catalog: Catalog, cfg: Config, model: str) -> ModelRoute | None:
        """``route`` on the catalog ``get`` just returned (the model lists checked once)."""
        key = (model, cfg.routing.unknown_model == "pass_through")
        if key not in self._routes:
            if len(self._routes) >= self.MAX_ROUTES:
                self._routes.clear()
            self._routes[key] = catalog.route(*key)
        return self._routes[key]


def as_api_error(err: LimitError) -> ApiError:
    return ApiError(err.status, err.message, type=err.type, param=err.param, code=err.code)


class ModelsPorts(Protocol):
    """What routing by model uses: the backends' model lists and the catalog built from them."""

    catalogs: CatalogCache
    models_info: ModelsLookup


def route_model(gw: ModelsPorts, parsed: ParsedRequest, cfg: Config) -> tuple[ModelRoute, Catalog]:
    """Where the request's model is served, and the catalog that says so (for ``check_length``:
    one look at the model lists per request); 404 ``model_not_found`` when nowhere."""
    catalog = gw.catalogs.get(cfg, gw.models_info)
    route = gw.catalogs.route_in(catalog, cfg, parsed.model)
    if route is None:
        raise as_api_error(model_not_found(parsed.model, catalog.served_ids()))
    return route, catalog


def check_length(
    catalog: Catalog, route: ModelRoute, parsed: ParsedRequest, prompt_tokens: int
) -> frozenset[str]:
    """vLLM's 400 when the request exceeds the model's largest limit; else the backends too small.

    Without ``max_tokens`` a server fills the rest of the context (vLLM), so only the prompt
    must fit: it must leave room for one token.
    """
    prompt = parsed.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        # Several prompts: each is its own sequence with its own limit (only the total is known here).
        return frozenset()
    given = parsed.max_tokens is not None
    asked = parsed.max_tokens if parsed.max_tokens is not None else 1
    err = context_length_error(route.limit, prompt_tokens, asked, given)
    if err is not None:
        raise as_api_error(err)
    return catalog.too_small(parsed.model, prompt_tokens + asked)
