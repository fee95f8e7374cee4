"""One clock for shared times: a process whose clock is shifted (libfaketime) measures its
offset to Redis ``TIME`` and its ``store.now()`` is Redis's clock; the embedded store's is 0.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from proxy.state.memory import InProcessStore

CHILD = """
import asyncio, sys, time
from proxy.config import StoreConfig
from proxy.state.redis_store import RedisStore

async def main() -> None:
    store = RedisStore(StoreConfig(redis_url=sys.argv[1]))
    offset = await store.sync_clock()
    print(offset, store.now(), time.time(), flush=True)
    await store.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("shift_s", [10.0, -0.5, -10.0])
def test_shifted_process_measures_its_offset_to_redis(redis_server: str, shift_s: float) -> None:
    spec = f"{shift_s:+g}s"
    before = time.time()
    out = subprocess.run(
        ["faketime", "-f", spec, sys.executable, "-c", CHILD, redis_server],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    after = time.time()
    offset, store_now, own = (float(x) for x in out.split())
    # libfaketime did shift the child's clock (else the test proves nothing)...
    assert before + shift_s - 0.05 <= own <= after + shift_s + 0.05, (own, before, after)
    # ...and the store's clock undoes it: Redis runs on this host's true clock.
    assert abs(offset + shift_s) < 0.05, offset
    assert before - 0.05 <= store_now <= after + 0.05, (store_now, before, after)


async def test_embedded_store_has_no_offset() -> None:
    store = InProcessStore()
    assert await store.sync_clock() == 0.0
    assert abs(store.now() - time.time()) < 0.05
