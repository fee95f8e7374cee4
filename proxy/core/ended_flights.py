"""KV that this gateway's flights held when they ended, until a report shows it freed.

The projection of a lazily allocating server (``proxy.gateway.memory_pressure``) lays this
gateway's flights over the server's last report and keeps any usage they do not explain
(other clients, work it cannot see) on top. A flight that ended since that report is no
longer among the flights, but the report still shows its blocks: they counted as foreign
usage until the next scrape (a second by default), so the room a finished document freed
stood empty for half a scrape interval on average while held requests waited for it. On a
fleet of decode servers full of documents that each decode for a few seconds, that is an
eighth of their KV (measured in the disaggregated benchmark, docs/results.md).

So the tokens a flight held at its end are kept here with the time it ended, and the
projection takes them out of a report read before that time. A report read after it shows
the server's own figure; the entry is dropped then, or once it is older than any report
still in use (``HORIZON_S``: a backend no projection reads, a contiguous one, is never
asked, and its entries must not pile up).

Pure: the caller gives the time (the store's clock, as reports carry it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Seconds an entry is kept at most: a report older than this is not ranked on (reports
#: expire after ``collector.report_ttl_s``, 60 s by default; stale ones far sooner).
HORIZON_S = 60.0


@dataclass
class EndedFlights:
    """Per backend: (when it ended, tokens it held) of flights ended since its last report."""

    _ended: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    # Per backend, the sum of its entries' tokens: every ranking asks for it, per node, and
    # a scrape interval of ends at a high request rate is hundreds of entries to add up.
    _tokens: dict[str, int] = field(default_factory=dict)

    def ended(self, backend: str, at: float, tokens: int) -> None:
        """A flight on ``backend`` ended at ``at`` holding ``tokens`` (its prompt and output)."""
        self._drop(backend, at - HORIZON_S, inclusive=False)
        if tokens > 0:
            self._ended.setdefault(backend, deque()).append((at, tokens))
            self._tokens[backend] = self._tokens.get(backend, 0) + tokens

    def since(self, backend: str, reported_at: float) -> int:
        """Tokens of flights ended after a report read at ``reported_at``: that report still
        counts them, the server no longer holds them. Older entries are dropped (reports
        only get newer)."""
        self._drop(backend, reported_at, inclusive=True)
        return self._tokens.get(backend, 0)

    def _drop(self, backend: str, before: float, inclusive: bool) -> None:
        """Drop ``backend``'s entries that ended before ``before`` (or at it)."""
        mine = self._ended.get(backend)
        if mine is None:
            return
        while mine and (mine[0][0] <= before if inclusive else mine[0][0] < before):
            self._tokens[backend] -= mine.popleft()[1]
        if not mine:
            del self._ended[backend]
            del self._tokens[backend]
