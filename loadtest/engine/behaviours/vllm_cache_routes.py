"""The simulated vLLM's prefix-cache endpoints: render a prompt to token ids, reset the cache.

* ``POST /v1/chat/completions/render`` and ``POST /v1/completions/render``: vLLM's render API
  (``vllm/entrypoints/serve/render``: the request turned into a token-in generate request
  without generating). Routers that match KV-cache events against a request use it to get
  the engine's own token ids (vllm-router ``kv_aware``, llm-d's token producer). The answer
  carries ``token_ids`` (the ids this engine prefills and publishes in ``BlockStored``),
  ``model`` and ``sampling_params``; completions answer a list, one per prompt.
* ``POST /reset_prefix_cache``: vLLM's dev endpoint. Every core forgets what its blocks
  cache and publishes ``AllBlocksCleared``; the process, its start time and its counters stay
  (``prefix_cache.PrefixCache.reset``), so a router that watches only the start time does
  not see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson
from aiohttp import web

from loadtest.engine.behaviours.prefix_cache import prompt_ids
from loadtest.engine.behaviours.scheduler import PagedCore
from loadtest.engine.protocol import BadRequest, error_body, parse_body

JSON = "application/json"


class Cores(Protocol):
    """What the routes read of the server (``app.Front``, which imports this module)."""

    @property
    def cores(self) -> Sequence[PagedCore]: ...


def _rendered(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    return {
        "model": body.get("model"),
        "token_ids": list(prompt_ids(body)),
        "sampling_params": {"max_tokens": max_tokens},
        "features": None,
    }


async def _render(request: web.Request, chat: bool) -> web.Response:
    try:
        body, p = parse_body(await request.read(), chat, 16)
    except BadRequest as exc:
        err = error_body(exc.message, exc.type, exc.param, exc.code)
        return web.Response(status=exc.status, body=err, content_type=JSON)
    rendered = _rendered(body, p.max_tokens)
    answer: Any = rendered if chat else [rendered]
    return web.Response(body=orjson.dumps(answer), content_type=JSON)


async def render_chat(request: web.Request) -> web.Response:
    return await _render(request, chat=True)


async def render_completion(request: web.Request) -> web.Response:
    return await _render(request, chat=False)


def reset_handler(front: Cores) -> Any:
    async def reset_prefix_cache(request: web.Request) -> web.Response:
        for core in front.cores:
            if core.prefix is not None:
                dropped = core.prefix.reset()
                core.cached_blocks = max(0, core.cached_blocks - dropped)
        return web.Response(status=200)

    return reset_prefix_cache


def add_routes(app: web.Application, front: Cores) -> None:
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/reset_prefix_cache", reset_handler(front))
