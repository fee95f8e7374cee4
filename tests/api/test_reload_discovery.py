"""Discovery and reloads share one road: the ConfigHolder (pure logic, a tiny fake source)."""

from __future__ import annotations

from proxy.api.reload import ConfigHolder
from proxy.api.wiring import follow_backends, keep_discovered
from proxy.backends.discovery import Discovery, backend
from proxy.config import Config, parse_config


class FakeSource(Discovery):
    async def _run(self) -> None:  # never started here
        return None

    async def first_list(self) -> None:
        return None


def cfg(static: list[str], threshold: int = 8000) -> Config:
    return parse_config(
        {
            "backends": [
                {"name": n, "url": f"http://127.0.0.1:{9000 + i}"} for i, n in enumerate(static)
            ],
            "discovery": {"type": "dns", "name": "inference.example"},
            "routing": {"long_threshold_tokens": threshold},
        },
        environ={},
    )


def test_discovered_backends_reach_the_holder_and_survive_a_reload() -> None:
    first = cfg(["static-a"])
    holder = ConfigHolder(first)
    seen: list[list[str]] = []
    holder.subscribe(lambda old, new: seen.append([b.name for b in new.backends]))
    source = FakeSource(first.discovery, first.backends)
    source.on_change.append(follow_backends(holder))

    source.publish([backend(first.discovery, "pod-1", "10.0.0.1", 8000)])
    assert [b.name for b in holder.current.backends] == ["static-a", "pod-1"]
    assert seen == [["static-a", "pod-1"]] and holder.generation == 2

    # A reloaded file changes the static list and a threshold; what discovery found stays.
    reloaded = keep_discovered(source)(cfg(["static-b"], threshold=9000))
    assert [b.name for b in reloaded.backends] == ["static-b", "pod-1"]
    assert reloaded.routing.long_threshold_tokens == 9000
    holder.swap(reloaded)
    # The next discovery change builds on the reloaded config, not the one it started with.
    source.publish([backend(first.discovery, "pod-2", "10.0.0.2", 8000)])
    assert [b.name for b in holder.current.backends] == ["static-b", "pod-2"]
    assert holder.current.routing.long_threshold_tokens == 9000


def test_without_discovery_a_reload_is_the_file() -> None:
    new = cfg(["x"])
    assert keep_discovered(None)(new) is new
