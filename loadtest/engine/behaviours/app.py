"""The HTTP front of a simulated vLLM / SGLang / TGI server: one port, ``data_parallel`` cores.

The front end tokenizes (cl100k, as the kvroute engine does), checks ``max_model_len``
with the server's own 400 (422 for TGI), picks the core with the shortest queue (vLLM's
data-parallel balancing looks at queue lengths, not KV space) and streams the tokens the
core produces. Nothing fails for lack of KV: requests wait in the core's FIFO queue.
A client that goes away frees what its request holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from loadtest.engine.behaviours import disaggregation, vllm_cache_routes
from loadtest.engine.behaviours.cores import SCHEDULERS, make_core
from loadtest.engine.behaviours.dialects import DIALECTS, Dialect, ServerFacts, models_body
from loadtest.engine.behaviours.eos import output_tokens
from loadtest.engine.behaviours.faults import (
    FaultRequestError,
    MidStreamFault,
    StreamJournal,
    StreamRecord,
    error_event,
    parse_fault,
)
from loadtest.engine.behaviours.kv_publisher import KvEventsOptions, attach_publishers
from loadtest.engine.behaviours.prefix_cache import prompt_blocks
from loadtest.engine.behaviours.scheduler import PagedCore, SimRequest
from loadtest.engine.behaviours.stream_pacing import Pacing
from loadtest.engine.metrics import exposition
from loadtest.engine.protocol import (
    SSE_DONE,
    BadRequest,
    Parsed,
    chunk,
    error_body,
    full_body,
    generated_text,
    parse_body,
    usage_chunk,
)
from proxy.gateway.sizing import count_prompt_async

JSON = "application/json"


@dataclasses.dataclass(frozen=True, slots=True)
class BehaviourConfig:
    """A simulated server: ``capacity_tokens`` of KV per core, ``data_parallel`` cores."""

    behaviour: str = "vllm"
    name: str = "engine"
    model: str = "sim-model"
    capacity_tokens: int = 100_000
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: one core's KV capacity
    data_parallel: int = 1
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0
    speedup: float = 1.0
    seed: int = 0
    prefix_caching: bool = True  # vLLM's automatic prefix caching (on by default in V1)
    serial_prefill: bool = False  # prefill one prompt after another (see scheduler.py)
    # The server's tokenizer counts this many tokens per token of the gateway's default count
    # (1.3: a Llama model behind a gateway that counts with cl100k). Shows in usage and KV.
    tokenizer_ratio: float = 1.0
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON (kv_publisher.py)
    # Disaggregated serving: prefill, decode or both (``disaggregation.py``).
    pd: disaggregation.RoleConfig = dataclasses.field(default_factory=disaggregation.RoleConfig)
    # Every stream's connection is reset after this many tokens (faults.py: ``die``).
    die_after_tokens: int | None = None
    # The scheduler model (``cores.py``): ``classic`` (scheduler.py) or ``v1`` (v1_scheduler.py).
    scheduler: str = "classic"
    max_num_batched_tokens: int = 8192  # v1: the token budget of one step
    step_base_ms: float = 10.0  # v1: a step's fixed time
    step_per_token_us: float | None = None  # v1: per scheduled token; None: 1/prefill rate
    # Tokens per SSE event (stream_pacing.py); None: 1 with v1 (vLLM's default), else 0
    # (everything new in one event, the classic model's way).
    stream_interval: int | None = None
    flush_interval_s: float = 0.0  # at most one flush per this many (wall) seconds

    def __post_init__(self) -> None:
        if self.behaviour not in DIALECTS:
            raise ValueError(
                f"behaviour must be one of {', '.join(DIALECTS)}, got {self.behaviour!r}"
            )
        if self.behaviour == "tgi" and self.data_parallel != 1:
            raise ValueError(
                "TGI has no data parallelism inside one router: --data-parallel must be 1"
            )
        for key in ("capacity_tokens", "block_size", "max_num_seqs", "data_parallel"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        if not self.tokenizer_ratio > 0:
            raise ValueError(f"tokenizer_ratio must be positive, got {self.tokenizer_ratio}")
        if self.kv_events_config is not None:
            KvEventsOptions.parse(self.kv_events_config)  # a bad flag fails at start, named
        self._check_scheduler()
        if self.capacity_tokens < self.block_size:
            raise ValueError("capacity_tokens must hold at least one block")
        if self.max_model_len is not None and not 0 < self.max_model_len <= self.capacity_tokens:
            # vLLM refuses to start when one sequence of max_model_len cannot fit the cache.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be within 1..capacity_tokens "
                f"({self.capacity_tokens})"
            )

    def _check_scheduler(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}"
            )
        if self.scheduler == "v1" and self.behaviour != "vllm":
            raise ValueError("--scheduler v1 models vLLM: it needs --behaviour vllm")
        if self.max_num_batched_tokens < 1 or self.step_base_ms < 0:
            raise ValueError("max_num_batched_tokens must be positive and step_base_ms >= 0")
        if self.step_per_token_us is not None and self.step_per_token_us < 0:
            raise ValueError(f"step_per_token_us must be >= 0, got {self.step_per_token_us}")
        if (self.stream_interval is not None and self.stream_interval < 0) or (
            self.flush_interval_s < 0
        ):
            raise ValueError("stream_interval and flush_interval_s must be >= 0")

    @property
    def pacing(self) -> Pacing:
        interval = self.stream_interval
        if interval is None:
            interval = 1 if self.scheduler == "v1" else 0
        return Pacing(interval, self.flush_interval_s)


class _Families(Collector):
    def __init__(self, front: Front) -> None:
        self._front = front

    def collect(self) -> list[Metric]:
        return list(self._front.dialect.families(self._front.facts))


class Front:
    """The API server: validation, engine choice, streaming; the cores do the scheduling."""

    def __init__(self, config: BehaviourConfig) -> None:
        self.config = config
        self.dialect: Dialect = DIALECTS[config.behaviour]
        self.cores = [make_core(config) for _ in range(config.data_parallel)]
        self.pacing = config.pacing
        self.publishers = attach_publishers(config.kv_events_config, self.cores)
        self.max_model_len = config.max_model_len or self.cores[0].capacity_tokens
        self.started_at = time.time()
        self._ids = secrets.token_hex(4)
        self._next = 0
        self._headers = {"x-engine-name": config.name}
        self.roles = disaggregation.Roles(config.pd, f"{config.name}-{self._ids}", config.speedup)
        self.fault: MidStreamFault | None = None
        if config.die_after_tokens is not None:
            self.fault = MidStreamFault("die", config.die_after_tokens)
        self.journal = StreamJournal()
        # Where the server listens (``BehaviourServer`` sets it): an SGLang prefill server's
        # bootstrap endpoint listens there too.
        self.host = "127.0.0.1"

    @property
    def facts(self) -> ServerFacts:
        return ServerFacts(self.config.model, self.max_model_len, self.started_at, self.cores)

    def state(self) -> dict[str, Any]:
        engines = [c.state() for c in self.cores]
        return {"behaviour": self.config.behaviour, "engines": engines, **self.roles.state()}

    async def start(self) -> None:
        await self.roles.start(self.host)
        for c in self.cores:
            c.start()
        for pub in self.publishers:
            pub.start()

    async def stop(self) -> None:
        for c in self.cores:
            await c.stop()
        for pub in self.publishers:
            await pub.close()
        await self.roles.close()

    # --- handlers ---------------------------------------------------------------------------

    def _answer(self, status: int, body: bytes) -> web.Response:
        return web.Response(status=status, body=body, content_type=JSON, headers=self._headers)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, chat=True)

    def _pinned_core(self, request: web.Request) -> PagedCore | None:
        """The core an ``X-data-parallel-rank`` header pins the request to (vLLM and SGLang
        read it; TGI has no data parallelism). A value that is not a number is ignored, as
        vLLM ignores it; a rank outside the engines is a 400, as vLLM's input check answers."""
        raw = request.headers.get("x-data-parallel-rank")
        if raw is None or self.config.behaviour == "tgi":
            return None
        try:
            rank = int(raw)
        except ValueError:
            return None
        if not 0 <= rank < len(self.cores):
            raise BadRequest(
                f"data_parallel_rank {rank} is out of range [0, {len(self.cores)}).",
                param="data_parallel_rank",
            )
        return self.cores[rank]

    async def _infer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body, p = parse_body(await request.read(), chat, 1)
        except BadRequest as exc:
            return self._answer(exc.status, error_body(exc.message, exc.type, exc.param, exc.code))
        if p.model != self.config.model:
            status, err = self.dialect.not_found(p.model)
            if status:
                return self._answer(status, err)
        try:
            pinned = self._pinned_core(request)
        except BadRequest as exc:
            return self._answer(exc.status, error_body(exc.message, exc.type, exc.param, exc.code))
        prompt = await count_prompt_async(body)
        if self.config.tokenizer_ratio != 1.0:
            prompt = max(1, round(prompt * self.config.tokenizer_ratio))
        explicit = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
        if not explicit:
            p = dataclasses.replace(
                p, max_tokens=self.dialect.default_max_tokens(self.facts, chat, prompt)
            )
        if prompt + p.max_tokens > self.max_model_len:
            return self._answer(*self.dialect.too_long(self.facts, prompt, p.max_tokens, explicit))
        arrival = await self.roles.arrive(body)
        if arrival.answer is not None:
            return arrival.answer
        if arrival.room is not None:
            # An SGLang prefill server computes the prompt and its first token only.
            p = dataclasses.replace(p, max_tokens=1)
        try:
            return await self._run(request, body, p, prompt, chat, arrival, pinned)
        finally:
            self.roles.ended(arrival)

    async def _run(
        self,
        request: web.Request,
        body: dict[str, Any],
        p: Parsed,
        prompt: int,
        chat: bool,
        arrival: disaggregation.Arrival,
        pinned: PagedCore | None = None,
    ) -> web.StreamResponse:
        """Submit the request to the least loaded core (or the one its header pins); stream it
        or answer when it is done."""
        core = pinned if pinned is not None else min(self.cores, key=lambda c: c.load())
        hashes, ids = (
            await self._prompt_hashes(body, prompt) if core.prefix is not None else ((), ())
        )
        now = asyncio.get_running_loop().time()
        # The simulated model's EOS (a prompt marker) may end it before max_tokens.
        output = output_tokens(body, p.max_tokens)
        req = SimRequest(prompt, output, now, hashes=hashes, block_ids=ids)
        arrival.req = req
        req.keep_blocks = arrival.hold
        req.transfer_tokens_per_s = arrival.transfer_tokens_per_s
        core.submit(req, now)
        self._next += 1
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{self._ids}-{self._next}"
        try:
            if p.stream:
                return await self._stream(request, req, p, completion_id, body)
            while not req.done:
                req.changed.clear()
                await req.changed.wait()
            text = generated_text(self._next + self.config.seed, req.max_tokens)
            written = dataclasses.replace(p, max_tokens=req.max_tokens)
            # The model's EOS ends it with "stop", as the stream's last chunk says.
            finish = _finish(req.max_tokens, req.max_tokens, p.max_tokens) or "length"
            answer = full_body(completion_id, int(time.time()), written, text, prompt, finish)
            if arrival.hold and not req.aborted:
                params = self.roles.hold(request, core, req)
                answer = disaggregation.with_params(answer, params)
            return web.Response(
                body=answer,
                content_type=JSON,
                headers=self._headers,
            )
        finally:
            core.abort(req)
            self.roles.unheld(core, req)

    async def _prompt_hashes(
        self, body: dict[str, Any], prompt: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The prompt's block hashes and their token ids (big prompts off the loop), never
        more blocks than it has."""
        bs = self.config.block_size
        if prompt > 2_000:
            hashes, ids = await asyncio.to_thread(prompt_blocks, body, bs)
        else:
            hashes, ids = prompt_blocks(body, bs)
        n = min(len(hashes), prompt // bs)
        return hashes[:n], ids[: n * bs]

    async def _stream(
        self,
        request: web.Request,
        req: SimRequest,
        p: Parsed,
        completion_id: str,
        body: dict[str, Any],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                **self._headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
        )
        await resp.prepare(request)
        fault = self.fault.take() if self.fault is not None else None
        record = self.journal.open(body)
        try:
            await self._relay_tokens(request, resp, req, p, completion_id, fault, record)
        finally:
            if record.end == "running":
                # The client went away (the handler cancelled, or a write failed).
                record.end = "cancelled"
        return resp

    async def _relay_tokens(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        req: SimRequest,
        p: Parsed,
        completion_id: str,
        fault: MidStreamFault | None,
        record: StreamRecord,
    ) -> None:
        created = int(time.time())
        sent = 0
        loop = asyncio.get_running_loop()
        flushed_at = -math.inf
        with contextlib.suppress(ConnectionError, RuntimeError):
            while sent < req.max_tokens:
                if fault is not None and sent >= fault.after_tokens:
                    await _strike(request, resp, fault, record)
                    return
                req.changed.clear()
                if not self.pacing.ready(sent, req.generated, req.max_tokens):
                    await req.changed.wait()
                    continue
                wait = flushed_at + self.pacing.flush_interval_s - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                new = req.generated - sent
                if fault is not None:
                    # Exactly ``after_tokens`` reach the client before the fault strikes.
                    new = min(new, fault.after_tokens - sent)
                if new <= 0:
                    continue
                events = [chunk(completion_id, created, p, None, None, role=True)]
                events = events if sent == 0 and p.chat else []
                for size in self.pacing.pieces(new):
                    text = generated_text(self.config.seed + sent, size)
                    sent += size
                    finish = _finish(sent, req.max_tokens, p.max_tokens)
                    events.append(chunk(completion_id, created, p, text, finish))
                    record.text.append(text)
                await resp.write(b"".join(events))
                flushed_at = loop.time()
            if p.include_usage:
                written = dataclasses.replace(p, max_tokens=req.max_tokens)
                cached = req.prompt_tokens - req.computed if req.scheduled_at is not None else 0
                await resp.write(
                    usage_chunk(completion_id, created, written, req.prompt_tokens, cached)
                )
            await resp.write(SSE_DONE)
            await resp.write_eof()
            record.end = "done"

    async def models(self, request: web.Request) -> web.StreamResponse:
        with_len = self.config.behaviour != "tgi"
        return self._answer(200, models_body(self.facts, self.dialect.owned_by, with_len))

    async def info(self, request: web.Request) -> web.StreamResponse:
        """TGI's ``/info``: the model and its token limits."""
        return self._answer(
            200,
            orjson.dumps(
                {
                    "model_id": self.config.model,
                    "max_input_tokens": self.max_model_len - 1,
                    "max_total_tokens": self.max_model_len,
                    "max_batch_total_tokens": self.cores[0].capacity_tokens,
                    "router": "text-generation-router",
                }
            ),
        )

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200, headers=self._headers)

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        data, content_type = exposition(request.app[REGISTRY_KEY])
        resp = web.Response(body=data, headers=self._headers)
        resp.headers["Content-Type"] = content_type
        return resp

    async def sleep(self, request: web.Request) -> web.StreamResponse:
        """vLLM's ``POST /sleep`` (dev mode): the engines offload and stop scheduling."""
        for c in self.cores:
            c.sleeping = True
        return web.Response(status=200, headers=self._headers)

    async def wake_up(self, request: web.Request) -> web.StreamResponse:
        now = asyncio.get_running_loop().time()
        for c in self.cores:
            c.sleeping = False
            c.step(now, 0)
        return web.Response(status=200, headers=self._headers)

    async def admin_state(self, request: web.Request) -> web.StreamResponse:
        return self._answer(200, orjson.dumps(self.state()))

    async def admin_fault(self, request: web.Request) -> web.StreamResponse:
        """``POST /admin/fault``: strike streams mid-answer (faults.py); GET: the fault now."""
        if request.method == "POST":
            try:
                self.fault = parse_fault(orjson.loads(await request.read() or b"{}"))
            except (FaultRequestError, orjson.JSONDecodeError) as exc:
                return self._answer(400, error_body(str(exc), "invalid_request_error", "mode"))
        f = self.fault
        state = {"mode": "none"} if f is None else {"mode": f.mode, "after_tokens": f.after_tokens}
        return self._answer(200, orjson.dumps(state | {"count": None if f is None else f.count}))

    async def admin_streams(self, request: web.Request) -> web.StreamResponse:
        """``GET /admin/streams``: the recent streams' bodies and texts (faults.StreamJournal)."""
        return self._answer(200, orjson.dumps(self.journal.as_json()))


async def _strike(
    request: web.Request, resp: web.StreamResponse, fault: MidStreamFault, record: StreamRecord
) -> None:
    """Cut this stream as ``fault`` says: reset, stall until the client leaves, or an error event."""
    if fault.mode == "die":
        record.end = "died"
        if request.transport is not None:
            request.transport.abort()
        return
    if fault.mode == "stall":
        record.end = "stalled"
        # Until the client gives up (the handler is cancelled then).
        await asyncio.Event().wait()
        return
    record.end = "error"
    await resp.write(error_event("the engine failed while generating (simulated)"))
    await resp.write(SSE_DONE)
    await resp.write_eof()


FRONT_KEY = web.AppKey("front", Front)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)


def build_app(config: BehaviourConfig) -> web.Application:
    front = Front(config)
    app = web.Application(client_max_size=256 * 1024 * 1024)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(front))
    app[FRONT_KEY] = front
    app[REGISTRY_KEY] = registry

    async def lifecycle(_app: web.Application) -> Any:
        await front.start()
        yield
        await front.stop()

    app.cleanup_ctx.append(lifecycle)
    r = app.router
    r.add_post("/v1/completions", front.completions)
    r.add_post("/v1/chat/completions", front.chat_completions)
    r.add_get("/v1/models", front.models)
    r.add_get("/health", front.health)
    r.add_get("/metrics", front.metrics)
    r.add_get("/admin/state", front.admin_state)
    disaggregation.add_routes(app, front.roles)
    r.add_route("*", "/admin/fault", front.admin_fault)
    r.add_get("/admin/streams", front.admin_streams)
    if config.behaviour == "vllm":
        r.add_post("/sleep", front.sleep)
        r.add_post("/wake_up", front.wake_up)
        vllm_cache_routes.add_routes(app, front)
    if config.behaviour == "tgi":
        r.add_get("/info", front.info)
    return app


def _finish(sent: int, output: int, max_tokens: int) -> str | None:
    """The chunk's finish reason: ``length`` at max_tokens, ``stop`` at the model's EOS."""
    if sent >= max_tokens:
        return "length"
    return "stop" if sent >= output else None
