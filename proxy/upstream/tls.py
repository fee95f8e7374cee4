"""One TLS verification context per process, built off the event loop.

Building httpx's default context reads and parses the whole CA bundle: measured 17 ms for
each new client and 96 ms for the first (which also imports certifi), all of it on the
event loop when a client was built inside a coroutine, a stall every request in flight
waits through. The collector, the restart hooks and anything else that talks to
``https://`` with the system's trust settings share this one context; it is built once, in
a worker thread, the first time one is asked for.
"""

from __future__ import annotations

import asyncio
import ssl

import httpx

_context: ssl.SSLContext | None = None
_building: asyncio.Future[ssl.SSLContext] | None = None


async def verifying_context() -> ssl.SSLContext:
    """httpx's default verifying context (certifi's CA bundle), shared by the whole process."""
    global _context, _building
    if _context is not None:
        return _context
    if _building is None or _building.get_loop() is not asyncio.get_running_loop():
        _building = asyncio.ensure_future(asyncio.to_thread(httpx.create_ssl_context))
    ctx = await asyncio.shield(_building)
    _context = ctx
    return ctx
