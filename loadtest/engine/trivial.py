"""A backend that answers at once: the fixed cost floor for router-overhead benchmarks.

It speaks just enough of the OpenAI API for a router to forward to it (chat and text
completions, streaming or not, ``/v1/models``, ``/health``) and exports the kvroute
allocator gauges on ``/metrics`` with a huge, never-changing free block, so kvroute's
collector marks it up and its fit check always passes. No tokenization, no allocator, no
sleeps: every answer is a pre-built byte string, so what a benchmark measures on top of
it is the router's own cost. Server: aiohttp.web on uvloop (the fastest Python stack
measured here for tiny POSTs, see docs/engine.md), accepting every waiting connection each
turn (``serve``).

    python -m loadtest.engine.trivial --port 9001 --stream-chunks 64
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import time
from collections.abc import Sequence

import orjson
from aiohttp import web

from proxy.api.eager_accept import EagerAccept
from proxy.core import backend_contract as contract

CAPACITY_TOKENS = 10_000_000


def completion_body(model: str, chat: bool) -> bytes:
    if chat:
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
        }
    else:
        choice = {"index": 0, "text": "ok", "finish_reason": "stop"}
    return orjson.dumps(
        {
            "id": "trivial-0",
            "object": "chat.completion" if chat else "text_completion",
            "created": 0,
            "model": model,
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def stream_event(model: str, chat: bool, text: str) -> bytes:
    if chat:
        choice: dict[str, object] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": None}
    obj = {
        "id": "trivial-0",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def metrics_text(started_at: float) -> bytes:
    c = contract
    lines = [
        f"# TYPE {c.CAPACITY} gauge",
        f"{c.CAPACITY} {CAPACITY_TOKENS}",
        f"# TYPE {c.FREE} gauge",
        f"{c.FREE} {CAPACITY_TOKENS}",
        f"# TYPE {c.LARGEST_FREE_BLOCK} gauge",
        f"{c.LARGEST_FREE_BLOCK} {CAPACITY_TOKENS}",
        f"# TYPE {c.ALLOCATOR_INFO} gauge",
        f'{c.ALLOCATOR_INFO}{{allocator="contiguous",block_size="1"}} 1',
        f"# TYPE {c.START_TIME} gauge",
        f"{c.START_TIME} {started_at}",
        f"# TYPE {c.RUNNING} gauge",
        f"{c.RUNNING} 0",
        f"# TYPE {c.WAITING} gauge",
        f"{c.WAITING} 0",
    ]
    return ("\n".join(lines) + "\n").encode()


def build_app(stream_chunks: int = 64, model: str = "trivial") -> web.Application:
    """The app; `stream_chunks` SSE events (plus ``[DONE]``) answer each ``stream: true`` request."""
    started_at = time.time()
    bodies = {True: completion_body(model, True), False: completion_body(model, False)}
    events = {
        chat: [stream_event(model, chat, f"t{i} ") for i in range(stream_chunks)]
        + [b"data: [DONE]\n\n"]
        for chat in (True, False)
    }
    models = orjson.dumps(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": 0, "owned_by": "kvroute"}],
        }
    )

    async def infer(request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        # A substring test, not a JSON parse: the backend must cost as little as possible.
        if b'"stream":true' not in raw.replace(b" ", b""):
            return web.Response(body=bodies[chat], content_type="application/json")
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        for ev in events[chat]:
            await resp.write(ev)  # one write per event: the relay sees them as they come
        await resp.write_eof()
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        return await infer(request, True)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await infer(request, False)

    async def get_models(request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=metrics_text(started_at), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", get_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serve until killed, taking every waiting connection each turn (``EagerAccept``): with
    libuv's one accept per turn, the backend alone (the ``direct`` target of the big-prompt
    benchmark) kept 60-70 of 150 new connections queued for up to 2.5 s."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server((host, port), backlog=4096)
    site = web.SockSite(runner, sock, backlog=4096)
    await site.start()
    EagerAccept(asyncio.get_running_loop(), sock, runner.server)  # type: ignore[arg-type]
    await asyncio.Event().wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.engine.trivial",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument(
        "--stream-chunks", type=int, default=64, help="SSE events per streaming answer (default 64)"
    )
    p.add_argument("--model", default="trivial")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.no_uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(build_app(args.stream_chunks, args.model), args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
