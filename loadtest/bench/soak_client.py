"""The fault soak's clients (loadtest.bench.soak_faults): the open-loop load, the storm.

``Client.one`` sends one streamed request to the replicas in turn (a refused connection is
resent to the next live one, as a load balancer would) and books its outcome in the window:
answered with its time to first token, or failed by cause (``killed_replica``: cut off with
the replica serving it). It keeps the demand in flight, the client's own count that the
reserved tokens are checked against. ``disconnect_storm``: clients that leave mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.local_fleet import Proc
from loadtest.workload import chat_overhead_tokens, make_prompt


@dataclass
class Window:
    answered: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, seconds)
    excess_reserved: int = 0
    excess_when: str = ""  # how long after which fault the largest excess was seen
    excess_detail: dict[str, Any] = field(default_factory=dict)  # who held it
    replicas: dict[str, dict[str, float]] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    quiet: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Client:
    """The load: open-loop, replicas in turn, a balancer's resend on a refused connection."""

    replicas: Sequence[Proc]
    inflight_demand: int = 0
    # The most in flight since the monitor's last sample: a request that just ended may
    # still be in the /fleet it reads (its release is a round trip behind the last byte).
    peak_demand: int = 0
    turn: int = 0
    prompts: dict[int, str] = field(default_factory=dict)
    killed_at: dict[str, float] = field(default_factory=dict)
    back_at: dict[str, float] = field(default_factory=dict)

    def cut_off_by_kill(self, name: str, start: float) -> bool:
        """A request to replica ``name`` broke because that replica was killed: it was in
        flight at the kill, or sent (on a pooled connection) while the replica was down."""
        killed = self.killed_at.get(name, -1.0)
        back = self.back_at.get(name, -1.0)
        down = back < killed
        return killed >= start or down or time.monotonic() - back < 1.0

    def prompt(self, tokens: int) -> str:
        bucket = max(1, tokens // 250 * 250)
        if bucket not in self.prompts:
            self.prompts[bucket] = make_prompt(bucket, random.Random(bucket))
        return self.prompts[bucket]

    async def one(self, c: httpx.AsyncClient, prompt: int, output: int, w: Window) -> None:
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": self.prompt(max(1, prompt - chat_overhead_tokens()))}],
            "max_tokens": output,
            "stream": True,
        }  # fmt: skip
        self.turn += 1
        n = len(self.replicas)
        order = [self.replicas[(self.turn + k) % n] for k in range(n)]
        self.inflight_demand += prompt + output
        self.peak_demand = max(self.peak_demand, self.inflight_demand)
        try:
            for target in order:
                start = time.monotonic()
                try:
                    outcome = await self._stream(c, target.url, body, start, w)
                    if outcome:
                        w.failures[outcome] += 1
                    return
                except httpx.ConnectError:
                    continue  # refused: a dead replica; the balancer resends
                except httpx.HTTPError:
                    killed = self.cut_off_by_kill(target.name, start)
                    w.failures["killed_replica" if killed else "lost"] += 1
                    return
            w.failures["no_replica"] += 1
        finally:
            self.inflight_demand -= prompt + output

    async def _stream(
        self, c: httpx.AsyncClient, url: str, body: dict[str, Any], start: float, w: Window
    ) -> str:
        async with c.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                code = (json.loads(raw or b"{}").get("error") or {}).get("code", "")
                return f"http_{resp.status_code}_{code}"
            first = True
            async for chunk in resp.aiter_bytes():
                if first and chunk:
                    w.ttft.append((start, time.monotonic() - start))
                    first = False
            w.answered += 1
            return ""


async def disconnect_storm(client: Client, c: httpx.AsyncClient, n: int = 20) -> None:
    """``n`` streams that leave after 0.5 s; their demand counts as in flight meanwhile."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi " * 200}],
            "max_tokens": 2000, "stream": True}  # fmt: skip
    demand = 200 + chat_overhead_tokens() + 2000

    async def leave(url: str) -> None:
        client.inflight_demand += demand
        client.peak_demand = max(client.peak_demand, client.inflight_demand)
        try:
            async with asyncio.timeout(0.5):
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass
        finally:
            client.inflight_demand -= demand

    k = len(client.replicas)
    await asyncio.gather(*(leave(client.replicas[i % k].url) for i in range(n)))
