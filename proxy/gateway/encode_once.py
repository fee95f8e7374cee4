"""One encode per new chunk at a time: requests bringing the same new text wait for it.

When many clients send the same new document at once (150 connections, one new 220 KB
document behind 64 different questions), every request found the document's chunks missing
and queued its own encode of all of them for the sizing thread: the first second of such a
burst was ~150 encodes of the same text, 15-25 ms each, before any request could leave. Here
a chunk already being encoded for one request is waited for by the others, which then size
from the chunk cache (``proxy.gateway.sizing``); only text nobody is encoding is encoded.

Per event loop (a process serving on several loops keeps one table each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

from proxy.core.chunk_count import EncodeJob
from proxy.gateway import sizing_pool

# id(loop) -> chunk key -> the future of the encode that will store it.
_tables: dict[int, dict[Hashable, asyncio.Future[None]]] = {}
_waiting = 0


async def encode(job: EncodeJob) -> bool:
    """Store ``job``'s chunks, or wait for the encodes already storing some of them.

    True: the chunk cache holds more now, size the request again. False: the job's ids could
    not be split at its chunks (size it whole instead).
    """
    loop = asyncio.get_running_loop()
    table = _tables.setdefault(id(loop), {})
    keys = [key for run in job.keys for key in run]
    busy = {id(f): f for key in keys if (f := table.get(key)) is not None}
    if busy:
        global _waiting
        _waiting += 1
        try:
            # Not cancelled with this request: the encode serves every request waiting on it.
            await asyncio.wait(busy.values())
        finally:
            _waiting -= 1
        return True
    done: asyncio.Future[None] = loop.create_future()
    for key in keys:
        table[key] = done
    try:
        return job.store(await sizing_pool.run(job.run))
    finally:
        for key in keys:
            if table.get(key) is done:
                del table[key]
        if not table:
            _tables.pop(id(loop), None)
        done.set_result(None)


def waiting() -> int:
    """Requests waiting for another's encode right now, on every loop (tests watch it)."""
    return _waiting
