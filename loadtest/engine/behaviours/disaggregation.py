"""Prefill and decode roles of a simulated vLLM server: vLLM's NIXL protocol, without GPUs.

What the roles do, as vLLM's NIXL connector does it (docs/disaggregation.md):

* **prefill** (``kv_role: kv_producer``; ``both`` too): a request whose
  ``kv_transfer_params`` ask ``do_remote_decode`` is computed as usual (one output token),
  but its blocks are *held* after it finishes, and its answer carries the params a decode
  server needs (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``, ``remote_request_id``). The blocks are freed when a
  decode server pulls them, or after ``hold_timeout_s`` without a pull (vLLM:
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default).
* **decode** (``kv_consumer``; ``both`` too): a request with ``do_remote_prefill`` pulls the
  blocks from the prefill server named in its params (``POST /kv/pull`` there stands for the
  NIXL read) and spends transfer time, not prefill time, on the pulled tokens; a request
  without params runs locally as on any server. A pull that fails (the prefill server died,
  the hold timed out) is answered with a 500, and nothing is generated.

The pull happens when the request arrives, not when the scheduler admits it (vLLM reads
once the decode side allocated the blocks): held blocks are freed a little sooner here.

Faults for tests: ``POST /admin/disaggregation {"refuse_decodes": N}`` makes the next N
remote-prefill requests fail with an out-of-memory error before any pull; with SGLang's
protocol, ``{"fail_prefills": M}`` makes the next M prefill requests answer a 500 at once
(their decode, left waiting in the room, would fail only at its waiting timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import secrets
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web

from loadtest.engine.behaviours.bootstrap_rooms import BootstrapRooms, RoomTimeouts
from loadtest.engine.behaviours.scheduler import PagedCore, SimRequest
from loadtest.engine.protocol import error_body

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
Protocol = Literal["nixl", "sglang"]
PROTOCOLS: tuple[Protocol, ...] = ("nixl", "sglang")
JSON = "application/json"


@dataclasses.dataclass(frozen=True, slots=True)
class RoleConfig:
    """A server's part in disaggregated serving (``kvroute engine --pd-role``)."""

    role: Role = "both"
    # Seconds a prefill server holds computed blocks for a pull (vLLM's default: 480).
    hold_timeout_s: float = 480.0
    # Pulled prompt tokens per second at the decode server (the KV transfer).
    transfer_tokens_per_s: float = 200_000.0
    # nixl: vLLM's kv_transfer_params; sglang: SGLang's bootstrap rooms (bootstrap_rooms.py).
    protocol: Protocol = "nixl"
    # sglang, prefill: the bootstrap endpoint's port (SGLang's default 8998; 0: any free one).
    bootstrap_port: int = 8998
    rooms: RoomTimeouts = dataclasses.field(default_factory=RoomTimeouts)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pd_role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"pd_protocol must be one of {', '.join(PROTOCOLS)}")
        if self.rooms.bootstrap_s <= 0 or self.rooms.waiting_s <= 0:
            raise ValueError("bootstrap and waiting timeouts must be positive")
        if self.hold_timeout_s <= 0 or self.transfer_tokens_per_s <= 0:
            raise ValueError("kv hold timeout and transfer rate must be positive")


@dataclasses.dataclass(slots=True)
class Arrival:
    """What the roles make of one request before it is submitted."""

    answer: web.Response | None = None  # answered here (a failed pull, a refusal)
    hold: bool = False  # prefill for a remote decode: keep the blocks after it ends
    transfer_tokens_per_s: float | None = None  # decode of pulled KV
    room: int | None = None  # sglang prefill: the room this request computes for
    req: SimRequest | None = None  # the request as submitted (the front sets it)


@dataclasses.dataclass(slots=True)
class _Hold:
    core: PagedCore
    req: SimRequest
    timer: asyncio.TimerHandle


class Roles:
    """One server's holds (prefill side) and pulls (decode side)."""

    def __init__(self, config: RoleConfig, engine_id: str, speedup: float = 1.0) -> None:
        self.config = config
        self.engine_id = engine_id
        self.speedup = speedup
        self.holds: dict[str, _Hold] = {}
        self.refuse_decodes = 0
        self.fail_prefills = 0
        self.pulled = 0
        self.expired = 0
        self._session: aiohttp.ClientSession | None = None
        self.rooms = BootstrapRooms(config.rooms, speedup)

    async def start(self, host: str) -> None:
        """An SGLang prefill server serves its bootstrap endpoint."""
        if self.config.protocol == "sglang" and self.config.role == "prefill":
            await self.rooms.start(host, self.config.bootstrap_port)

    async def close(self) -> None:
        for key in list(self.holds):
            self._free(key)
        if self._session is not None:
            await self._session.close()
        await self.rooms.close()

    # --- a request arrives ------------------------------------------------------------------

    async def arrive(self, body: dict[str, Any]) -> Arrival:
        if self.config.protocol == "sglang" and self.config.role != "both":
            return await self._arrive_sglang(body)
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            return Arrival()
        if params.get("do_remote_decode") and self.config.role != "decode":
            # vLLM's proxy never streams step 1; a stream here just runs as usual.
            return Arrival(hold=not body.get("stream"))
        if params.get("do_remote_prefill") and self.config.role != "prefill":
            return await self._pull(params)
        return Arrival()

    async def _arrive_sglang(self, body: dict[str, Any]) -> Arrival:
        """SGLang's protocol: a prefill waits for its decode to join; a decode waits for the KV."""
        if self.config.role == "prefill":
            if self.fail_prefills > 0:
                self.fail_prefills -= 1
                message = "the prefill failed (simulated fault) before its room was opened"
                return Arrival(answer=_error(500, message, "InternalServerError"))
            room, answer = await self.rooms.wait_for_decode(body)
            return Arrival(answer=answer, room=room)
        refused = self._refused()
        if refused is not None:
            return refused
        joined = await self.rooms.join(body)
        if joined.answer is not None:
            return Arrival(answer=joined.answer)
        return Arrival(transfer_tokens_per_s=self.config.transfer_tokens_per_s * self.speedup)

    def ended(self, arrival: Arrival) -> None:
        """An SGLang prefill request ended: its KV went out if it was computed, else the room aborts."""
        if arrival.room is not None:
            req = arrival.req
            sent = req is not None and req.done and not req.aborted
            self.rooms.end(arrival.room, sent)

    def _refused(self) -> Arrival | None:
        """The test fault: the next N decodes fail out of memory before any transfer."""
        if self.refuse_decodes <= 0:
            return None
        self.refuse_decodes -= 1
        message = "KV cache out of memory: cannot allocate blocks for the remote prefill"
        return Arrival(answer=_error(503, message, "server_error"))

    async def _pull(self, params: dict[str, Any]) -> Arrival:
        refused = self._refused()
        if refused is not None:
            return refused
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/kv/pull"
        key = str(params.get("remote_request_id"))
        try:
            async with self._client().post(url, json={"remote_request_id": key}) as resp:
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}: {await resp.text()}")
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            message = f"KV transfer from {params.get('remote_engine_id')} failed: {exc}"
            return Arrival(answer=_error(500, message, "InternalServerError"))
        rate = self.config.transfer_tokens_per_s * self.speedup
        return Arrival(transfer_tokens_per_s=rate)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    # --- prefill side ----------------------------------------------------------------------

    def hold(self, request: web.Request, core: PagedCore, req: SimRequest) -> dict[str, Any]:
        """Keep a finished prefill's blocks for a pull; the params its answer carries."""
        key = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.config.hold_timeout_s / self.speedup, self._expire, key)
        self.holds[key] = _Hold(core, req, timer)
        blocks = req.blocks + len(req.hashes)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": list(range(blocks)),
            "remote_host": request.url.host,
            "remote_port": request.url.port,
            "remote_request_id": key,
            "tp_size": 1,
        }

    def unheld(self, core: PagedCore, req: SimRequest) -> None:
        """A prefill that finished but was never held (its answer was not sent): free it now."""
        if req.keep_blocks and req.done and not req.aborted:
            if not any(h.req is req for h in self.holds.values()):
                req.keep_blocks = False
                core.free_held(req, asyncio.get_running_loop().time())

    async def pull_handler(self, request: web.Request) -> web.Response:
        """``POST /kv/pull``: a decode server read the blocks; they are free again here."""
        try:
            key = str((await request.json())["remote_request_id"])
        except (ValueError, KeyError, TypeError):
            return _error(400, "remote_request_id is required", "BadRequestError")
        if key not in self.holds:
            return _error(404, f"no KV held for {key} (pulled or timed out)", "NotFoundError")
        self._free(key)
        self.pulled += 1
        return web.Response(status=200, body=b"{}", content_type=JSON)

    async def fault_handler(self, request: web.Request) -> web.Response:
        """``POST /admin/disaggregation {"refuse_decodes": N, "fail_prefills": M}``: the next N
        decodes fail out of memory; (sglang) the next M prefills answer a 500 at once."""
        body = await request.json()
        self.refuse_decodes = int(body.get("refuse_decodes", 0))
        self.fail_prefills = int(body.get("fail_prefills", 0))
        return web.Response(status=200, body=orjson.dumps(self.state()), content_type=JSON)

    def _expire(self, key: str) -> None:
        if key in self.holds:
            self._free(key)
            self.expired += 1

    def _free(self, key: str) -> None:
        hold = self.holds.pop(key)
        hold.timer.cancel()
        hold.core.free_held(hold.req, asyncio.get_running_loop().time())

    def state(self) -> dict[str, Any]:
        held = sum(h.req.blocks + len(h.req.hashes) for h in self.holds.values())
        return {
            **self.rooms.state(),
            "pd_protocol": self.config.protocol,
            "pd_role": self.config.role,
            "kv_holds": len(self.holds),
            "kv_held_blocks": held,
            "kv_pulled": self.pulled,
            "kv_expired": self.expired,
        }


def with_params(answer: bytes, params: dict[str, Any]) -> bytes:
    """A completion body with the prefill server's ``kv_transfer_params`` added."""
    body = orjson.loads(answer)
    body["kv_transfer_params"] = params
    return orjson.dumps(body)


def _error(status: int, message: str, type_: str) -> web.Response:
    return web.Response(status=status, body=error_body(message, type_), content_type=JSON)


def add_routes(app: web.Application, roles: Roles) -> None:
    app.router.add_post("/kv/pull", roles.pull_handler)
    app.router.add_post("/admin/disaggregation", roles.fault_handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``kvroute engine`` flags of the roles (vllm behaviour)."""
    d = RoleConfig()
    parser.add_argument(
        "--pd-role",
        choices=ROLES,
        default=d.role,
        help="vllm: disaggregated serving role (prefill holds KV for a pull; decode pulls it)",
    )
    parser.add_argument(
        "--kv-hold-timeout-s",
        type=float,
        default=d.hold_timeout_s,
        help="prefill: seconds held blocks wait for a pull (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)",
    )
    parser.add_argument(
        "--kv-transfer-tokens-per-s",
        type=float,
        default=d.transfer_tokens_per_s,
        help="decode: pulled prompt tokens per second",
    )
    parser.add_argument(
        "--pd-protocol",
        choices=PROTOCOLS,
        default=d.protocol,
        help="disaggregation protocol: nixl (vLLM's kv_transfer_params) or sglang (bootstrap rooms)",
    )
    parser.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=d.bootstrap_port,
        help="sglang prefill: the bootstrap endpoint's port (0: any free port, in /admin/state)",
    )
    parser.add_argument(
        "--bootstrap-timeout-s",
        type=float,
        default=d.rooms.bootstrap_s,
        help="sglang prefill: seconds a request waits for its decode server to join "
        "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
    )
    parser.add_argument(
        "--waiting-timeout-s",
        type=float,
        default=d.rooms.waiting_s,
        help="sglang decode: seconds a request waits for its KV "
        "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
    )


def role_config_from_args(args: argparse.Namespace) -> RoleConfig:
    d = RoleConfig()
    return RoleConfig(
        role=getattr(args, "pd_role", d.role),
        hold_timeout_s=getattr(args, "kv_hold_timeout_s", d.hold_timeout_s),
        transfer_tokens_per_s=getattr(args, "kv_transfer_tokens_per_s", d.transfer_tokens_per_s),
        protocol=getattr(args, "pd_protocol", d.protocol),
        bootstrap_port=getattr(args, "disaggregation_bootstrap_port", d.bootstrap_port),
        rooms=RoomTimeouts(
            bootstrap_s=getattr(args, "bootstrap_timeout_s", d.rooms.bootstrap_s),
            waiting_s=getattr(args, "waiting_timeout_s", d.rooms.waiting_s),
        ),
    )
