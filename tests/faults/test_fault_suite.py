"""Faults injected into real processes while a bounded load runs; nothing may be lost.

One fleet (redis-server, three engines, one gateway; all subprocesses) serves the whole
module; each scenario injects its fault during a few seconds of load, then heals the fleet
and checks that the gateway recovered without a restart and that no reservation is left.
Counts per scenario: sent / ok / failed (a well-formed error with the right code) / lost
(no answer or a wrong one). No timing is asserted; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import pytest

from tests.faults.harness import (
    KILLED_REPLICA_TTL_S,
    RESULTS,
    FaultFleet,
    Tally,
    after,
    body,
    counter_total,
    metric_values,
    new_client,
    record,
    recovered,
    run_load,
    send,
    wait_for,
)

pytestmark = pytest.mark.faults

STREAM_BROKEN = "stream:upstream_stream_broken"


def check_recovery(fleet: FaultFleet, tally: Tally) -> Tally:
    """Heal, then a round of requests must all succeed (same gateway process) and nothing stays reserved."""
    fleet.heal()
    after_fault = asyncio.run(recovered(fleet.url))
    assert after_fault.ok == after_fault.sent, after_fault.summary()
    fleet.assert_no_reservations()
    assert fleet.gateways[0].alive, "the gateway must recover without a restart"
    return after_fault


async def get_json(url: str) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(url, timeout=5).json()
        return data

    return await asyncio.to_thread(get)


def test_fault_baseline(fleet: FaultFleet) -> None:
    tally = asyncio.run(run_load(fleet.url, 2.0))
    record(RESULTS, "baseline (no fault)", tally)
    assert tally.ok > 0 and tally.lost == 0 and tally.failed == 0, tally.summary()
    fleet.assert_no_reservations()


def test_fault_redis_killed_and_restarted(fleet: FaultFleet) -> None:
    fleet.heal()

    async def scenario() -> tuple[Tally, dict[str, Any]]:
        load = asyncio.create_task(run_load(fleet.url, 5.0))
        await after(1.0, fleet.kill_redis)
        await asyncio.sleep(1.5)  # past max_snapshot_age_s: routing by length only by now
        during = await get_json(fleet.url + "/health")
        # On this thread: redis-server dies with the thread that started it (PR_SET_PDEATHSIG).
        fleet.restart_redis()
        return await load, during

    tally, during = asyncio.run(scenario())
    record(RESULTS, "redis killed + restarted", tally, health_during=during["status"])
    assert during["status"] == "degraded" and during["store"] == "unreachable", during
    assert tally.lost == 0 and tally.failed == 0, tally.summary()
    wait_for(
        lambda: not fleet.fleet_state()["degraded"],
        20,
        "the gateway to leave degraded mode by itself",
    )
    check_recovery(fleet, tally)


def test_fault_redis_paused(fleet: FaultFleet) -> None:
    """SIGSTOP: Redis accepts connections and never answers; the breaker keeps requests moving."""
    fleet.heal()
    opened_before = metric_values(fleet.url, "kvroute_store_circuit_opened").get("", 0.0)

    async def scenario() -> tuple[Tally, dict[str, Any]]:
        load = asyncio.create_task(run_load(fleet.url, 5.0))
        await after(1.0, fleet.redis.pause)
        await asyncio.sleep(1.5)
        during = await get_json(fleet.url + "/health")
        await asyncio.to_thread(fleet.redis.resume)
        return await load, during

    tally, during = asyncio.run(scenario())
    record(RESULTS, "redis paused (SIGSTOP)", tally, health_during=during["status"])
    assert during["status"] == "degraded", during
    assert tally.lost == 0 and tally.failed == 0, tally.summary()
    assert metric_values(fleet.url, "kvroute_store_circuit_opened")[""] > opened_before
    # Releases that failed while Redis was paused (and reserves it ran on resume) are retried.
    check_recovery(fleet, tally)


def test_fault_backend_killed_mid_load(fleet: FaultFleet) -> None:
    fleet.heal()

    async def scenario() -> Tally:
        load = asyncio.create_task(run_load(fleet.url, 4.0, max_tokens=200))
        await after(1.0, lambda: fleet.kill_engine(0))
        return await load

    tally = asyncio.run(scenario())
    record(RESULTS, "backend killed mid-load", tally, failed_codes=dict(tally.failed_codes))
    assert tally.lost == 0, tally.summary()
    # Only streams that had already sent bytes from the killed backend may fail, and they
    # must end with the SSE error event; everything else was retried on another backend.
    assert set(tally.failed_codes) <= {STREAM_BROKEN}, tally.summary()
    assert tally.ok > tally.failed
    check_recovery(fleet, tally)


def test_fault_backend_killed_mid_stream(fleet: FaultFleet) -> None:
    fleet.heal()
    urls = {f"e{i}": i for i in range(len(fleet.engines))}

    async def one_stream(
        client: httpx.AsyncClient, started: asyncio.Queue[str]
    ) -> tuple[str, str, str]:
        from tests.faults.harness import judge_sse

        async with client.stream(
            "POST", fleet.url + "/v1/chat/completions", json=body(True, max_tokens=3000)
        ) as resp:
            backend = resp.headers.get("x-kvroute-backend", "")
            chunks = []
            async for chunk in resp.aiter_raw():
                if not chunks:
                    started.put_nowait(backend)
                chunks.append(chunk)
            bucket, detail = judge_sse(b"".join(chunks))
            return bucket, detail, backend

    async def scenario() -> tuple[Tally, str]:
        started: asyncio.Queue[str] = asyncio.Queue()
        async with new_client() as client:
            streams = [asyncio.create_task(one_stream(client, started)) for _ in range(6)]
            first = await asyncio.wait_for(started.get(), 20)
            for _ in range(5):
                await asyncio.wait_for(started.get(), 20)
            await asyncio.to_thread(fleet.kill_engine, urls[first])
            tally = Tally()
            for bucket, detail, backend in await asyncio.gather(*streams):
                tally.add(bucket, detail, backend)
                if backend == first:
                    assert (bucket, detail) == ("failed", STREAM_BROKEN)
                else:
                    assert bucket == "ok", detail
        return tally, first

    tally, killed = asyncio.run(scenario())
    record(RESULTS, "backend killed mid-stream", tally, killed=killed)
    assert tally.lost == 0 and tally.failed >= 1, tally.summary()
    check_recovery(fleet, tally)


@pytest.mark.parametrize("mode", ["hang", "garbage", "error500"])
def test_fault_backend_misbehaves(fleet: FaultFleet, mode: str) -> None:
    """hang: accepts, never answers; garbage: 200 with junk; error500: plain 500s."""
    fleet.heal()
    before = metric_values(fleet.url, "kvroute_outlier_ejections").get("e0", 0.0)

    async def scenario() -> Tally:
        load = asyncio.create_task(run_load(fleet.url, 5.0))
        await after(0.5, lambda: fleet.fault(0, mode))
        return await load

    tally = asyncio.run(scenario())
    ejections = metric_values(fleet.url, "kvroute_outlier_ejections").get("e0", 0.0) - before
    record(RESULTS, f"backend {mode}", tally, ejections=int(ejections))
    assert tally.lost == 0 and tally.failed == 0, tally.summary()
    assert ejections >= 1, "passive outlier detection must eject the misbehaving backend"
    check_recovery(fleet, tally)


def test_fault_clients_disconnect_mid_stream(fleet: FaultFleet) -> None:
    fleet.heal()

    async def quitter(client: httpx.AsyncClient) -> None:
        async with client.stream(
            "POST", fleet.url + "/v1/chat/completions", json=body(True, max_tokens=3000)
        ) as resp:
            assert resp.status_code == 200
            async for _ in resp.aiter_raw():
                break  # first bytes in, then the client goes away

    async def scenario() -> Tally:
        load = asyncio.create_task(run_load(fleet.url, 3.0))
        async with new_client() as client:
            for _ in range(3):
                await asyncio.gather(*(quitter(client) for _ in range(8)))
        return await load

    tally = asyncio.run(scenario())
    record(RESULTS, "clients disconnect mid-stream", tally, disconnected=24)
    assert tally.lost == 0 and tally.failed == 0, tally.summary()

    def engines_idle() -> bool:
        for p in fleet.engines:
            st = httpx.get(p.url + "/admin/state", timeout=5).json()
            if st["free_tokens"] != st["capacity_tokens"]:
                return False
        return True

    wait_for(engines_idle, 20, "every engine to free the memory of the abandoned streams")
    check_recovery(fleet, tally)


async def slow_client(
    url: str, payload: bytes, pieces: int, pause_s: float, finish: bool = True
) -> tuple[int, bytes]:
    """Send the body a few bytes at a time (or never finish it); return (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode()
        writer.write(head)
        step = max(1, len(payload) // pieces)
        sent = 0
        while sent < len(payload):
            if not finish and sent >= len(payload) // 2:
                await asyncio.sleep(pause_s * pieces)  # stalls half way, holding the connection
                return 0, b""
            writer.write(payload[sent : sent + step])
            await writer.drain()
            sent += step
            await asyncio.sleep(pause_s)
        raw = await asyncio.wait_for(reader.read(), 30)
        status_line, _, rest = raw.partition(b"\r\n")
        return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]
    finally:
        writer.close()


def test_fault_slow_sending_clients(fleet: FaultFleet) -> None:
    fleet.heal()
    import orjson

    payload = orjson.dumps(body(False))

    async def scenario() -> tuple[Tally, list[tuple[int, bytes]]]:
        load = asyncio.create_task(run_load(fleet.url, 3.0))
        stalled = [
            asyncio.create_task(slow_client(fleet.url, payload, 20, 0.2, finish=False))
            for _ in range(20)
        ]
        slow = await asyncio.gather(*(slow_client(fleet.url, payload, 20, 0.1) for _ in range(8)))
        tally = await load
        for t in stalled:
            t.cancel()
        await asyncio.gather(*stalled, return_exceptions=True)
        return tally, slow

    tally, slow = asyncio.run(scenario())
    record(
        RESULTS,
        "slow-sending clients",
        tally,
        slow_ok=sum(1 for s, _ in slow if s == 200),
        stalled=20,
    )
    assert tally.lost == 0 and tally.failed == 0, tally.summary()
    assert [s for s, _ in slow] == [200] * len(slow), slow
    check_recovery(fleet, tally)


def test_fault_gateway_replica_killed(fleet: FaultFleet) -> None:
    """Two replicas share Redis; SIGKILL one mid-load.

    A client-side balancer (as any L4/L7 load balancer does) resends a request whose
    connection to the *killed* replica was refused or reset to the survivor. Those resends
    are the balancer's doing and are counted apart: every request first sent to the
    survivor must be answered by the survivor itself, with no resend. The killed replica
    holds reservations only their TTL can end, so it runs with a short TTL of its own while
    the survivor keeps the suite's long one (a leak of the survivor's would stay visible).
    """
    fleet.heal()
    replica = fleet.start_gateway(reservation_ttl_s=KILLED_REPLICA_TTL_S)
    fleet.wait_ready(replica.url)
    urls = [fleet.url, replica.url]
    turn = [0]
    resent: list[str] = []  # the first target of every request the balancer resent
    survivor = Tally()  # requests first sent to the survivor, as it answered them

    async def balanced(client: httpx.AsyncClient, req: dict[str, Any]) -> tuple[str, str, str]:
        turn[0] += 1
        first = urls[turn[0] % 2]
        bucket, detail, backend = await send(client, first, req)
        if first == fleet.url:
            survivor.add(bucket, detail, backend)
            return bucket, detail, backend  # never resent: the survivor must answer on its own
        if bucket == "lost" and detail.startswith("no answer"):
            resent.append(first)
            return await send(client, fleet.url, req)
        return bucket, detail, backend

    async def scenario() -> Tally:
        load = asyncio.create_task(run_load(fleet.url, 4.0, stream_share=0, sender=balanced))
        await after(1.5, lambda: replica.signal(signal.SIGKILL))
        return await load

    retries_before = counter_total(fleet.url, "kvroute_retries")
    tally = asyncio.run(scenario())
    gateway_retries = counter_total(fleet.url, "kvroute_retries") - retries_before
    record(
        RESULTS,
        "gateway replica killed (SIGKILL)",
        tally,
        lb_resends=len(resent),
        survivor_direct=survivor.sent,
        gateway_retries=int(gateway_retries),
    )
    assert not replica.alive
    assert survivor.sent > 0 and survivor.ok == survivor.sent, survivor.summary()
    assert set(resent) <= {replica.url}, "only requests to the killed replica may be resent"
    assert tally.lost == 0 and tally.failed == 0, tally.summary()
    # The backends were healthy throughout: the survivor had nothing to retry upstream.
    assert gateway_retries == 0, gateway_retries
    fleet.gateways.remove(replica)
    # The killed replica's reservations end by their (short) TTL; the survivor's ledger and
    # everything it reserved must be empty well before the suite's long TTL.
    time.sleep(KILLED_REPLICA_TTL_S)
    fleet.assert_no_reservations()
    check_recovery(fleet, tally)


def test_fault_gateway_graceful_shutdown(fleet: FaultFleet) -> None:
    """SIGTERM a replica mid-stream: it stops accepting, finishes its streams, releases everything."""
    fleet.heal()
    replica = fleet.start_gateway()
    fleet.wait_ready(replica.url)

    async def stream(
        client: httpx.AsyncClient, started: asyncio.Queue[None]
    ) -> tuple[str, str, str]:
        from tests.faults.harness import judge_sse

        async with client.stream(
            "POST", replica.url + "/v1/chat/completions", json=body(True, max_tokens=1500)
        ) as resp:
            chunks = []
            async for chunk in resp.aiter_raw():
                if not chunks:
                    started.put_nowait(None)
                chunks.append(chunk)
            bucket, detail = judge_sse(b"".join(chunks))
            return bucket, detail, resp.headers.get("x-kvroute-backend", "")

    async def scenario() -> Tally:
        started: asyncio.Queue[None] = asyncio.Queue()
        async with new_client() as client:
            tasks = [asyncio.create_task(stream(client, started)) for _ in range(4)]
            for _ in tasks:
                await asyncio.wait_for(started.get(), 20)
            replica.signal(signal.SIGTERM)
            tally = Tally()
            for bucket, detail, backend in await asyncio.gather(*tasks):
                tally.add(bucket, detail, backend)
        return tally

    tally = asyncio.run(scenario())
    record(RESULTS, "gateway graceful shutdown (SIGTERM)", tally)
    assert tally.ok == tally.sent == 4, tally.summary()
    assert replica.popen is not None
    replica.popen.wait(40)
    fleet.gateways.remove(replica)
    fleet.assert_no_reservations()  # released at shutdown, not left to expire (TTL 600 s)
    check_recovery(fleet, tally)
