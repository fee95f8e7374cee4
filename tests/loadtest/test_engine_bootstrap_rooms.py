"""The simulated engine's SGLang PD mode: rooms on the prefill side, joins from the decode side.

Real HTTP on 127.0.0.1 between two ``BootstrapRooms`` (a prefill's bootstrap endpoint and a
decode's client); simulated seconds divided by a large speedup, and waits on conditions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest

from loadtest.engine.behaviours.bootstrap_rooms import BootstrapRooms, RoomTimeouts
from tests.support.engines import free_port

FAST = RoomTimeouts(bootstrap_s=300.0, waiting_s=300.0)


@pytest.fixture
async def prefill() -> AsyncIterator[BootstrapRooms]:
    rooms = BootstrapRooms(FAST, speedup=1.0)
    await rooms.start("127.0.0.1", 0)
    yield rooms
    await rooms.close()


@pytest.fixture
async def decode() -> AsyncIterator[BootstrapRooms]:
    rooms = BootstrapRooms(FAST, speedup=1.0)
    yield rooms
    await rooms.close()


def body(rooms: BootstrapRooms, room: int) -> dict[str, object]:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": rooms.port, "bootstrap_room": room}


def message(answer: object) -> str:
    return str(orjson.loads(answer.body)["error"]["message"])  # type: ignore[attr-defined]


async def test_the_prefill_computes_once_the_decode_joined_and_the_decode_gets_the_kv(
    prefill: BootstrapRooms, decode: BootstrapRooms
) -> None:
    waiting = asyncio.create_task(prefill.wait_for_decode(body(prefill, 7)))
    await asyncio.sleep(0)
    # The prefill request waits in its bootstrap queue: nobody joined yet.
    assert not waiting.done()
    joined = asyncio.create_task(decode.join(body(prefill, 7)))
    room, answer = await waiting
    assert (room, answer) == (7, None)
    # Computed and sent: the decode's join ends with the KV.
    assert not joined.done()
    prefill.end(7, sent=True)
    assert (await joined).answer is None
    assert prefill.state()["bootstrap_served"] == 1 and prefill.rooms == {}


async def test_an_aborted_room_fails_the_decode_as_sglang_does(
    prefill: BootstrapRooms, decode: BootstrapRooms
) -> None:
    waiting = asyncio.create_task(prefill.wait_for_decode(body(prefill, 8)))
    joined = asyncio.create_task(decode.join(body(prefill, 8)))
    await waiting
    prefill.end(8, sent=False)
    answer = (await joined).answer
    assert answer is not None and answer.status == 500
    assert "KVTransferError(bootstrap_room=8): " in message(answer)
    assert "Aborted by AbortReq" in message(answer)


async def test_a_dead_prefill_server_fails_the_decode_at_once(decode: BootstrapRooms) -> None:
    dead = {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 9}
    answer = (await decode.join(dead)).answer
    assert answer is not None and answer.status == 500
    assert "it might be dead" in message(answer)


async def test_each_side_times_out_when_the_other_never_comes(prefill: BootstrapRooms) -> None:
    quick = BootstrapRooms(RoomTimeouts(bootstrap_s=0.05, waiting_s=0.05), speedup=1.0)
    await quick.start("127.0.0.1", 0)
    try:
        room, answer = await quick.wait_for_decode(body(quick, 10))
        assert room is None and answer is not None and answer.status == 500
        assert "Prefill bootstrap failed" in message(answer)
        assert quick.rooms == {} and quick.state()["bootstrap_timed_out"] == 1
        # A decode that joins a room no prefill request ever comes to gives up, and the room goes.
        answer = (await quick.join(body(prefill, 11))).answer
        assert answer is not None and answer.status == 500
        assert "waiting_timeout" in message(answer)
    finally:
        await quick.close()
    await _until(lambda: prefill.rooms == {})


async def test_a_request_without_a_room_is_refused_with_sglangs_400(
    prefill: BootstrapRooms, decode: BootstrapRooms
) -> None:
    _, answer = await prefill.wait_for_decode({"prompt": "x"})
    assert answer is not None and answer.status == 400
    assert "without bootstrap room id" in message(answer)
    refused = (await decode.join({"prompt": "x"})).answer
    assert refused is not None and refused.status == 400


async def _until(cond: object) -> None:
    for _ in range(500):
        if cond():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")
