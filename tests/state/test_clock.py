"""One clock for shared times: a process whose clock is shifted (libfaketime) measures its
offset to Redis ``TIME`` and its ``store.now()`` is Redis's clock; the embedded store's is 0.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.state.memory import InProcessStore
from tests.support.faketime import leftovers, leftovers_removed, shifted_env


@pytest.fixture(autouse=True)
def _remove_faketime_leftovers() -> Iterator[None]:
    with leftovers_removed():
        yield


# The stores here wait up to 5 s per Redis call: these tests are about clocks, not timeouts, and
# the gateway's 0.1 s default failed them on a loaded machine.
CHILD = """
import asyncio, sys, time
from proxy.config import StoreConfig
from proxy.state.redis_store import RedisStore

async def main() -> None:
    store = RedisStore(StoreConfig(redis_url=sys.argv[1], op_timeout_s=5.0))
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
        [sys.executable, "-c", CHILD, redis_server],
        env=shifted_env(spec),
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


RESERVE_CHILD = """
import asyncio, sys
from proxy.config import StoreConfig
from proxy.state.redis_store import RedisStore

async def main() -> None:
    store = RedisStore(StoreConfig(redis_url=sys.argv[1], key_prefix=sys.argv[2], op_timeout_s=5.0))
    await store.sync_clock()
    print("ready", flush=True)
    sys.stdin.readline()
    ok = await store.reserve("n1", "r-behind", 25_000, store.now(), 60, grace_s=0.25)
    print(ok, flush=True)
    await store.close()

asyncio.run(main())
"""


async def test_replica_half_a_second_behind_never_overcommits(redis_server: str) -> None:
    """Behind by 0.5 s, its reservation would look older than the report just taken, count
    as already inside it, and let a second 25k reservation into the same 30k gap."""
    from proxy.config import StoreConfig
    from proxy.core.fleet import MemoryReport
    from proxy.state.redis_store import RedisStore

    prefix = f"kvr-clock-{time.monotonic_ns()}"
    child = await asyncio.create_subprocess_exec(
        *[sys.executable, "-c", RESERVE_CHILD, redis_server, prefix],
        env=shifted_env("-0.5s"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    store = RedisStore(StoreConfig(redis_url=redis_server, key_prefix=prefix, op_timeout_s=5.0))
    try:
        assert child.stdout is not None and child.stdin is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"ready"
        await store.sync_clock()
        now = store.now()
        report = MemoryReport(
            capacity_tokens=30_000,
            free_tokens=30_000,
            largest_free_block_tokens=30_000,
            reported_at=now,
        )
        await store.put_report("n1", report, 60)
        child.stdin.write(b"go\n")
        await child.stdin.drain()
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"True"
        # The report is older than the first reservation: it must still count as pending.
        assert not await store.reserve("n1", "r-true", 25_000, store.now(), 60, grace_s=0.25)
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        await store.close()


def test_shifted_child_starts_over_leftovers_named_for_its_pid() -> None:
    """CI once failed here: a ``faketime`` wrapper given the pid of one killed earlier found
    its semaphore still there and refused to start (``sem_open: File exists``)."""
    for _ in range(3):  # another process may take the pids set aside; try again then
        last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
        planted = [path for pid in range(last + 1, last + 200) for path in leftovers(pid)]
        for path in planted:
            Path(path).write_bytes(b"stale")
        try:
            child = subprocess.run(
                [sys.executable, "-c", "import os, time; print(os.getpid(), time.time())"],
                env=shifted_env("+10s"),
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
        finally:
            for path in planted:
                Path(path).unlink(missing_ok=True)
        pid, shifted_now = child.stdout.split()
        if last < int(pid) < last + 200:
            assert float(shifted_now) > time.time() + 9  # started, and its clock is shifted
            return
    pytest.fail("no child was given one of the pids set aside")
