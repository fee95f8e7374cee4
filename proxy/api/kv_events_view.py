"""What ``/fleet`` shows of each backend's KV-event feeds: the prefix source routing uses.

``prefix_source`` is ``events`` while the backend's own KV-cache events are live, else
``approximate`` (the gateway's record of what it sent). ``kv_events`` details each rank.
"""

from __future__ import annotations

from typing import Any

from proxy.backends.kv_events import KvEventFeeds


def with_prefix_source(
    items: list[dict[str, Any]], feeds: KvEventFeeds | None, now: float
) -> list[dict[str, Any]]:
    ranks: dict[str, list[dict[str, Any]]] = {}
    if feeds is not None:
        for backend, rank, feed in feeds.feeds():
            st = feed.stats
            ranks.setdefault(backend, []).append(
                {
                    "rank": rank,
                    "endpoint": feed.endpoint,
                    "synced": st.synced,
                    "index_blocks": feed.index.blocks(),
                    "age_s": round(now - st.last_message_at, 3) if st.last_message_at else None,
                    "gaps": st.gaps,
                    "malformed": st.malformed,
                }
            )
    for item in items:
        name = item["name"]
        item["prefix_source"] = feeds.source(name, now) if feeds is not None else "approximate"
        if name in ranks:
            item["kv_events"] = sorted(ranks[name], key=lambda r: int(r["rank"]))
    return items
