"""SGLang's disaggregation protocol on a simulated server: bootstrap rooms, without GPUs.

What SGLang's servers do (``sglang/srt/disaggregation/``; docs/disaggregation.md):

* a router sends the *same* request to a prefill and a decode server at once, with
  ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` added; a server in prefill or
  decode mode answers 400 ("Disaggregated request received without bootstrap room id") to
  a request without a room;
* the **prefill** server runs a bootstrap endpoint on ``--disaggregation-bootstrap-port``
  (8998 by default). Its request waits in a bootstrap queue until the decode server joined the
  room (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, 300 s, then it fails), then the prompt is
  computed and its KV sent; the request ends (one token) once the KV went out, and its blocks
  are free;
* the **decode** server asks the prefill server's bootstrap endpoint for the room, preallocates
  and waits for the KV (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s); a transfer that
  fails or never comes fails the request with a 500 ("Decode transfer failed for request ...
  KVTransferError(bootstrap_room=...)"), nothing generated.

Here, one HTTP call stands for the handshake and the transfer: the decode server's
``POST /bootstrap/room {"bootstrap_room": N}`` on the prefill server's bootstrap port joins
the room and answers once the prompt is computed (200: the KV came; 410: the prefill request
was aborted). A prefill server that dies refuses or drops that call: the decode fails at once,
as SGLang's heartbeat to a dead prefill server makes it fail within seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
from aiohttp import web

from loadtest.engine.protocol import error_body

JSON = "application/json"
NO_ROOM = "Disaggregated request received without bootstrap room id"


@dataclasses.dataclass(frozen=True, slots=True)
class RoomTimeouts:
    """SGLang's two waits, in simulated seconds (divided by the speedup)."""

    # The prefill request waits this long for the decode server to join.
    bootstrap_s: float = 300.0
    # The decode request waits this long for the KV.
    waiting_s: float = 300.0


@dataclasses.dataclass(slots=True)
class Room:
    """One transfer on the prefill side."""

    joined: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    sent: bool = False
    # The prefill request arrived: it ends the room whichever way it goes.
    prefilling: bool = False


@dataclasses.dataclass(slots=True)
class Joined:
    """What joining a room gave the decode side: None, or the error answer."""

    answer: web.Response | None = None


class BootstrapRooms:
    """A server's rooms (prefill side) and its joins of other servers' rooms (decode side)."""

    def __init__(self, timeouts: RoomTimeouts, speedup: float = 1.0) -> None:
        self.timeouts = timeouts
        self.speedup = speedup
        self.rooms: dict[int, Room] = {}
        self.served = 0
        self.aborted = 0
        self.timed_out = 0
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # --- the bootstrap endpoint (prefill side) ---------------------------------------------

    async def start(self, host: str, port: int) -> None:
        """Serve ``POST /bootstrap/room`` on ``port`` (0: any free port, see ``self.port``)."""
        app = web.Application()
        app.router.add_post("/bootstrap/room", self.join_handler)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        addrs = self._runner.addresses
        self.port = int(addrs[0][1]) if addrs else port

    async def close(self) -> None:
        for room in self.rooms.values():
            room.ended.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def join_handler(self, request: web.Request) -> web.Response:
        """A decode server joins a room; answered once the KV went out (or the room ended)."""
        try:
            room_id = int((await request.json())["bootstrap_room"])
        except (ValueError, KeyError, TypeError):
            return _error(400, "bootstrap_room (an integer) is required", "BadRequestError")
        room = self.rooms.setdefault(room_id, Room())
        room.joined.set()
        try:
            await room.ended.wait()
        finally:
            if not room.ended.is_set() and not room.prefilling:
                # The decode left before any prefill request came: nobody else ends it.
                self.rooms.pop(room_id, None)
        if not room.sent:
            return _error(410, "Aborted by AbortReq.", "KVTransferError")
        return web.Response(status=200, body=b"{}", content_type=JSON)

    # --- a prefill request ------------------------------------------------------------------

    async def wait_for_decode(self, body: dict[str, Any]) -> tuple[int | None, web.Response | None]:
        """The prefill request's bootstrap queue: its room once the decode joined, or an answer."""
        room_id = body.get("bootstrap_room")
        if not isinstance(room_id, int):
            return None, _error(400, NO_ROOM, "BadRequestError")
        room = self.rooms.setdefault(room_id, Room())
        room.prefilling = True
        try:
            async with asyncio.timeout(self.timeouts.bootstrap_s / self.speedup):
                await room.joined.wait()
        except TimeoutError:
            self.timed_out += 1
            self.end(room_id, sent=False)
            message = f"Prefill bootstrap failed for request bootstrap_room={room_id}: timed out"
            return None, _error(500, message, "KVTransferError")
        except BaseException:
            self.end(room_id, sent=False)
            raise
        return room_id, None

    def end(self, room_id: int, sent: bool) -> None:
        """The prefill request ended: its KV went out (``sent``) or the room is aborted."""
        room = self.rooms.pop(room_id, None)
        if room is None:
            return
        room.sent = sent
        room.ended.set()
        if sent:
            self.served += 1
        else:
            self.aborted += 1

    # --- a decode request -------------------------------------------------------------------

    async def join(self, body: dict[str, Any]) -> Joined:
        """Join the room on the prefill server named in ``body``; wait for the KV."""
        room_id = body.get("bootstrap_room")
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(room_id, int) or not host:
            return Joined(_error(400, NO_ROOM, "BadRequestError"))
        url = f"http://{host}:{port}/bootstrap/room"
        timeout = aiohttp.ClientTimeout(total=self.timeouts.waiting_s / self.speedup)
        try:
            async with self._client().post(
                url, json={"bootstrap_room": room_id}, timeout=timeout
            ) as resp:
                if resp.status == 200:
                    return Joined()
                reason = (await resp.text())[:200]
        except TimeoutError:
            reason = f"Request {room_id} waiting_timeout"
        except (OSError, aiohttp.ClientError):
            reason = "Failed to get kvcache from prefill instance, it might be dead"
        message = (
            f"Decode transfer failed for request bootstrap_room={room_id} with exception "
            f"KVTransferError(bootstrap_room={room_id}): {reason}"
        )
        return Joined(_error(500, message, "InternalServerError"))

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def state(self) -> dict[str, Any]:
        return {
            "bootstrap_port": self.port,
            "bootstrap_rooms": len(self.rooms),
            "bootstrap_served": self.served,
            "bootstrap_aborted": self.aborted,
            "bootstrap_timed_out": self.timed_out,
        }


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(status=status, body=error_body(message, type_), content_type=JSON)
