"""Discovery's loop stops even when a library below turns the cancellation into its own error.

Pure loop logic: the source is a tiny fake whose ``_run`` does what an HTTP or DNS client's
timeout helper can do when a cancellation races its deadline (swallow it and raise its own
timeout). Before, ``stop()`` cancelled once and awaited the task: the loop caught that
error, backed off, and ran on, so the await never returned (and shutdown hung).
"""

from __future__ import annotations

import asyncio

from proxy.backends.discovery import Discovery
from proxy.config import DiscoveryConfig


class SwallowingSource(Discovery):
    """A source whose every wait turns a cancellation into a TimeoutError."""

    def __init__(self) -> None:
        super().__init__(DiscoveryConfig(type="dns", name="inference.example"), [])
        self.runs = 0
        self.running = asyncio.Event()

    async def first_list(self) -> None:
        return None

    async def _run(self) -> None:
        self.runs += 1
        self.running.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise TimeoutError("the library's own timeout") from None


def test_stop_ends_a_loop_whose_source_swallows_the_cancellation() -> None:
    async def main() -> tuple[bool, int]:
        source = SwallowingSource()
        await source.start()
        await source.running.wait()
        task = source._task
        assert task is not None
        # Bounded by design: the old stop never returned here; 30 s only guards the suite.
        async with asyncio.timeout(30):
            await source.stop()
        return task.done(), source.runs

    done, runs = asyncio.run(main())
    assert done and runs >= 1


def test_a_stopped_source_starts_again() -> None:
    async def main() -> bool:
        source = SwallowingSource()
        await source.start()
        await source.running.wait()
        await source.stop()
        source.running.clear()
        await source.start()
        await source.running.wait()
        running = source._task is not None and not source._task.done()
        await source.stop()
        return running

    assert asyncio.run(main())
