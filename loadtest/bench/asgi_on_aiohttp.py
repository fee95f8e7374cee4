"""A minimal ASGI adapter on aiohttp.web's server: to measure that server under the gateway.

Only what the benchmark's two routes need (HTTP/1.1, a request body, a streamed or whole
response, the lifespan); not a general ASGI server and not shipped in ``proxy/``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web


def serve_asgi(app: Any, port: int) -> None:
    import uvloop

    lifespan_q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    lifespan_done: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def lifespan_receive() -> dict[str, Any]:
        return await lifespan_q.get()

    async def lifespan_send(msg: dict[str, Any]) -> None:
        await lifespan_done.put(msg)

    async def on_startup(_: web.Application) -> None:
        task = asyncio.ensure_future(
            app(
                {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                lifespan_receive,
                lifespan_send,
            )
        )
        web_app["lifespan"] = task
        await lifespan_q.put({"type": "lifespan.startup"})
        await lifespan_done.get()

    async def on_cleanup(_: web.Application) -> None:
        await lifespan_q.put({"type": "lifespan.shutdown"})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(lifespan_done.get(), 10)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.raw_path.encode(),
            "root_path": "",
            "query_string": request.query_string.encode(),
            "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers.items()],
            "client": request.transport.get_extra_info("peername") if request.transport else None,
            "server": ("127.0.0.1", port),
            "state": {},
        }
        sent_body = False
        disconnected = asyncio.Event()
        response: web.StreamResponse | None = None

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            nonlocal response
            if msg["type"] == "http.response.start":
                response = web.StreamResponse(status=msg["status"])
                for k, v in msg.get("headers", []):
                    response.headers.add(k.decode(), v.decode())
                await response.prepare(request)
            elif msg["type"] == "http.response.body":
                assert response is not None
                if msg.get("body"):
                    await response.write(msg["body"])
                if not msg.get("more_body", False):
                    await response.write_eof()

        try:
            await app(scope, receive, send)
        finally:
            disconnected.set()
        assert response is not None
        return response

    web_app = web.Application()
    web_app.router.add_route("*", "/{tail:.*}", handle)
    web_app.on_startup.append(on_startup)
    web_app.on_cleanup.append(on_cleanup)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(web_app, host="127.0.0.1", port=port, access_log=None, print=None, backlog=4096)
