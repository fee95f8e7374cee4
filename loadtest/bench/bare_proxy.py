"""The overhead benchmark's floor: a do-nothing round-robin relay, aiohttp.web + aiohttp client.

A few dozen lines with no routing, no sizing, no store: what any Python proxy on the same
libraries pays per request. ``loadtest.bench.overhead`` reports kvroute against it
(``x_bare-aiohttp-proxy``), the stand-in for vllm-router where that is not installed.

    python -m loadtest.bench.bare_proxy --port 9000 --backends http://127.0.0.1:8001,...
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import aiohttp

NOTE = "a few dozen lines: aiohttp.web + aiohttp client, round robin, no routing"


def _hop(headers: Any) -> dict[str, str]:
    from proxy.upstream.client import forward_headers

    return forward_headers(headers, False)


def serve(backends: list[str], port: int) -> None:
    """Relay each POST to the next backend in turn until the process is stopped."""
    import uvloop
    from aiohttp import web

    state: dict[str, Any] = {"i": 0}

    async def on_startup(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0), auto_decompress=False
        )

    async def on_cleanup(app: web.Application) -> None:
        await state["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        state["i"] += 1
        url = backends[state["i"] % len(backends)] + request.path
        async with state["session"].post(url, data=body, headers=_hop(request.headers)) as resp:
            ctype = resp.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                return web.Response(
                    body=await resp.read(), status=resp.status, headers={"Content-Type": ctype}
                )
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": ctype})
            await out.prepare(request)
            async for c in resp.content.iter_any():
                await out.write(c)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench.bare_proxy", description=NOTE)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backends", required=True, help="comma-separated backend URLs")
    a = p.parse_args(argv)
    serve(a.backends.split(","), a.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
