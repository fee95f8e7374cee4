"""The fault soak's reserved-token checks (loadtest.bench.soak_faults).

``reserved_tokens``: every backend's reserved tokens in the first live replica's ``/fleet``,
sampled under load against the demand in flight. ``quiet_moment``: the load pauses, every
request in flight ends, and the check is how long until nothing is reserved anywhere: in
every live replica's ``/fleet`` and in Redis itself (``soak_redis.live_reserved``). A
release that never reached Redis, or a dead replica's lease that does not lapse, shows here
as reserved tokens that stay past a lease TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import redis

from loadtest.bench.soak_redis import SoakRedis, live_reserved
from loadtest.local_fleet import Proc

#: how long a quiet moment waits for reservations to reach 0 before it says they did not
QUIET_WATCH_S = 30.0


def fleet_reserved(url: str) -> int | None:
    """The sum of ``overlay.reserved_tokens`` over a replica's ``/fleet``; None: no answer."""
    got = fleet_json(url)
    return None if got is None else int(got["reserved"])


def fleet_json(url: str) -> dict[str, Any] | None:
    """A replica's ``/fleet``: ``reserved`` (the sum), ``by_lease`` (``replicas.reserved_tokens``)."""
    try:
        got = httpx.get(url + "/fleet", timeout=2).json()
        reserved = sum(int(b["overlay"]["reserved_tokens"]) for b in got["backends"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return {"reserved": reserved, "by_lease": (got.get("replicas") or {}).get("reserved_tokens")}


def lease_owner(lease: str, replicas: Sequence[Proc]) -> str:
    """The replica (by its pid, in ``<host>-<pid>-<random>.<epoch>``) a lease id belongs to."""
    parts = lease.split("-")
    pids = {str(r.popen.pid): r.name for r in replicas if r.popen is not None}
    return pids.get(parts[-2], lease) if len(parts) >= 3 else lease or "(no lease)"


def reserved_tokens(replicas: Sequence[Proc]) -> tuple[int | None, dict[str, Any]]:
    """Every backend's reserved tokens in the first live replica's ``/fleet`` that answers,
    and who holds them: tokens per lease, named by replica where it is one of ``replicas``."""
    for r in replicas:
        if r.alive:
            got = fleet_json(r.url)
            if got is not None:
                by = {lease_owner(k, replicas): sum(v.values()) for k, v in (got["by_lease"] or {}).items()}  # fmt: skip
                return int(got["reserved"]), {"read_from": r.name, "by_holder": by}
    return None, {}


def reserved_everywhere(
    replicas: Sequence[Proc], store: SoakRedis, backends: Sequence[str]
) -> dict[str, int | None]:
    """Reserved tokens per live replica's ``/fleet``, and in Redis (``redis``)."""
    out: dict[str, int | None] = {r.name: fleet_reserved(r.url) for r in replicas if r.alive}
    try:
        out["redis"] = live_reserved(store.client(), backends)
    except (redis.RedisError, OSError, ValueError):
        out["redis"] = None
    return out


async def quiet_moment(
    replicas: Sequence[Proc],
    store: SoakRedis,
    backends: Sequence[str],
    inflight: set[asyncio.Task[None]],
    lease_ttl_s: float,
) -> dict[str, Any]:
    """Wait for the requests in flight to end, then until every count reads 0.

    ``zero_after_s``: from the last request's end to the first read where every live replica
    and Redis answer 0 (None: not within ``QUIET_WATCH_S``); ``within_lease_ttl``: that
    took no longer than ``lease_ttl_s``. ``at_quiet``: the first read after the last end.
    """
    t0 = time.monotonic()
    if inflight:
        await asyncio.wait(set(inflight), timeout=150)
    quiet = time.monotonic()
    first: dict[str, int | None] | None = None
    last: dict[str, int | None] = {}
    zero_after: float | None = None
    while time.monotonic() - quiet < QUIET_WATCH_S:
        last = await asyncio.to_thread(reserved_everywhere, replicas, store, backends)
        first = last if first is None else first
        if all(v == 0 for v in last.values()):
            zero_after = time.monotonic() - quiet
            break
        await asyncio.sleep(0.05)
    return {
        "drain_s": round(quiet - t0, 2),
        "still_in_flight": sum(1 for t in inflight if not t.done()),
        "at_quiet": first,
        "zero_after_s": None if zero_after is None else round(zero_after, 2),
        "within_lease_ttl": zero_after is not None and zero_after <= lease_ttl_s,
        "left": None if zero_after is not None else last,
    }


def own_reserved(url: str) -> int:
    """Tokens reserved under the replica's own lease, as its ``/fleet`` shows them (0: none)."""
    try:
        rep = httpx.get(url + "/fleet", timeout=2).json()["replicas"]
        return sum(int(v) for v in rep.get("reserved_tokens", {}).get(rep["this"], {}).values())
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return 0


def wait_holding(url: str, timeout_s: float = 30.0) -> int:
    """Poll until the replica holds reservations of its own (what a kill should take with it);
    the tokens it held, or 0 after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = own_reserved(url)
        if held:
            return held
        time.sleep(0.05)
    return 0
