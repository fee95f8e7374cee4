"""One backend's scrape: fetch its ``/metrics``, parse it, and keep its fall/rise count.

The collector (``proxy.backends.collector``) runs rounds, holds the shared lock and writes to
the store; what happens for a single backend lives here so it can be read on its own: the
bounded HTTP fetch, the parse into a ``MemoryReport`` (``proxy.backends.parse``), and the
bookkeeping that turns a run of outcomes into what to write (a backend is marked down after
``collector.fall`` failed scrapes in a row and up again after ``collector.rise`` good ones).
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import httpx

from proxy.backends.parse import ScrapeError, pages_for, parse_report
from proxy.backends.scrape_pages import read_pages
from proxy.config import BackendConfig, CollectorConfig
from proxy.core.fleet import MemoryReport
from proxy.core.slot_limit import SlotLimit, SlotSource, next_slot_limit

log = logging.getLogger("kvroute.collector")

MAX_BODY_BYTES = 16 * 1024 * 1024  # far above any real /metrics page; stops a runaway body
ACCEPT = (
    "text/plain;version=0.0.4;q=1.0, */*;q=0.1"  # the classic text format that the parser reads
)
#: What a scrape's outcome asks the collector to write: the report, a mark_down with the
#: status's reason, or nothing yet (a failure short of ``fall``).
Write = Literal["report", "down", "hold"]
#: How a scrape ended, in a few fixed words (the label of ``kvroute_scrapes_total``):
#: ``connect`` (refused, unreachable), ``timeout``, ``http_status`` (not 200),
#: ``bad_metrics`` (too large, or not a report this backend's kind can give), ``transport``
#: (another HTTP failure: a reset mid-body, a malformed answer).
ScrapeCause = Literal["ok", "connect", "timeout", "http_status", "bad_metrics", "transport"]
CAUSES: tuple[ScrapeCause, ...] = get_args(ScrapeCause)


@dataclass(frozen=True, slots=True)
class ScrapeOutcome:
    """One backend's result in one round: a report, or the reason it was marked down."""

    name: str
    report: MemoryReport | None
    reason: str = ""
    latency_s: float = 0.0
    cause: ScrapeCause = "ok"

    @property
    def ok(self) -> bool:
        return self.report is not None


@dataclass(slots=True)
class BackendStatus:
    """One backend's scrape history on this replica (shown by ``Collector.status``)."""

    outcome: Literal["ok", "down", "never"] = "never"
    reason: str = ""
    latency_s: float | None = None
    last_scrape_at: float = 0.0
    last_success_at: float = 0.0
    consecutive_failures: int = 0
    consecutive_ok: int = 0
    scrapes_total: int = 0
    failures_total: int = 0
    # Scrapes by how they ended (``ScrapeCause``), for ``kvroute_scrapes_total``.
    results: dict[str, int] = dataclasses.field(default_factory=dict)
    # Queueing servers: the running-request limit as learned from reports
    # (``proxy.core.slot_limit``), and where the figure in use came from.
    slot_limit: SlotLimit = dataclasses.field(default_factory=SlotLimit)
    slots_source: SlotSource = "unknown"

    @property
    def slots(self) -> int:
        """The learned limit (0: not known)."""
        return self.slot_limit.limit

    def with_slots(self, report: MemoryReport, configured: int | None) -> MemoryReport:
        """The report with ``max_num_seqs`` filled in: exported, configured, else learned."""
        if not report.queueing:
            return report
        if report.max_num_seqs:
            self.slots_source = "exported"
            return report
        if configured:
            self.slots_source = "configured"
            return dataclasses.replace(report, max_num_seqs=configured)
        self.slot_limit = next_slot_limit(self.slot_limit, report, report.reported_at)
        limit = self.slot_limit.limit
        self.slots_source = "learned" if limit else "unknown"
        return dataclasses.replace(report, max_num_seqs=limit) if limit else report

    def record(self, o: ScrapeOutcome, now: float, fall: int, rise: int) -> Write:
        """Count one scrape and say what to write (a mark_down carries ``self.reason``)."""
        self.scrapes_total += 1
        self.results[o.cause] = self.results.get(o.cause, 0) + 1
        self.last_scrape_at = now
        self.latency_s = o.latency_s
        if o.report is not None:
            self.last_success_at = now
            self.consecutive_failures = 0
            self.consecutive_ok += 1
            # A backend marked down needs ``rise`` good scrapes in a row to be up again.
            if self.outcome == "down" and self.consecutive_ok < rise:
                self.reason = f"recovering: {self.consecutive_ok} of {rise} good scrapes"
                return "down"
            if self.outcome == "down":
                log.info("collector: backend %s is reachable again", o.name)
            self.outcome, self.reason = "ok", ""
            return "report"
        self.consecutive_failures += 1
        self.consecutive_ok = 0
        self.failures_total += 1
        # ``fall`` failures in a row mark it down (one slow scrape does not).
        if self.outcome != "down" and self.outcome != "never" and self.consecutive_failures < fall:
            # Still up on its last report, which ages; the reason is kept for /metrics.
            self.reason = f"{o.reason} ({self.consecutive_failures} of {fall} failed scrapes)"
            return "hold"
        if self.outcome != "down":
            log.warning("collector: backend %s marked down: %s", o.name, o.reason)
        self.outcome, self.reason = "down", o.reason
        return "down"


def scrape_client(slots: int, cc: CollectorConfig, tls: ssl.SSLContext) -> httpx.AsyncClient:
    """The HTTP client for ``slots`` concurrent scrapes (no scrape waits for a connection).

    ``tls``: a ready verifying context (``proxy.upstream.tls``); without one, httpx would
    build its own here, reading the CA bundle on the event loop.
    """
    return httpx.AsyncClient(
        verify=tls,
        timeout=httpx.Timeout(cc.timeout_s),
        limits=httpx.Limits(
            max_connections=slots,
            max_keepalive_connections=slots,
            keepalive_expiry=2.0 * cc.scrape_interval_s + 5.0,  # reuse connections across rounds
        ),
        headers={"Accept": ACCEPT, "User-Agent": "kvroute-collector"},
        follow_redirects=False,
        trust_env=False,  # backends are scraped directly, never through an environment proxy
    )


async def scrape(
    client: httpx.AsyncClient,
    backend: BackendConfig,
    timeout_s: float,
    clock: Callable[[], float],
) -> ScrapeOutcome:
    """Fetch and parse one backend's metrics; every failure is an outcome, never a raise."""
    path = (
        backend.metrics_path if backend.metrics_path.startswith("/") else "/" + backend.metrics_path
    )
    url = backend.plain_url + path
    cred = backend.credential()
    taken_at = clock()  # the figures are no older than this
    started = time.perf_counter()
    deadline = started + timeout_s
    try:
        # Kinds that need more than /metrics (llama.cpp's /slots, /props), same deadline;
        # first, so that what they show is as near as can be to ``taken_at``.
        pages = await read_pages(client, backend, pages_for(backend.kind), deadline, timeout_s)
        # Bounded by httpx's own per-phase timeouts (connect, send, each read) plus the
        # deadline checked per chunk, which stops a server that drips its body. Not by
        # asyncio.timeout: a native cancellation racing httpx's timeouts can be lost.
        async with client.stream(
            "GET", url, headers={"authorization": cred} if cred is not None else None
        ) as resp:
            if resp.status_code != 200:
                raise ScrapeError(f"HTTP {resp.status_code} from {path}", "http_status")
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise ScrapeError(f"metrics body larger than {MAX_BODY_BYTES} bytes")
                if time.perf_counter() > deadline:
                    raise ScrapeError(
                        f"timeout after {timeout_s:g}s (body still arriving)", "timeout"
                    )
        text = body.decode("utf-8", errors="replace")  # the text format is UTF-8 by definition
        report = parse_report(
            backend.kind, text, taken_at, backend.capacity_tokens, pages, backend.kv_layout
        )
    except ScrapeError as exc:
        cause = exc.cause if exc.cause in CAUSES else "bad_metrics"
        return _failed(backend, exc.reason, started, cause)
    except httpx.TimeoutException:
        return _failed(backend, f"timeout after {timeout_s:g}s", started, "timeout")
    except httpx.ConnectError as exc:
        reason = f"connect error: {exc or type(exc).__name__}"
        return _failed(backend, reason, started, "connect")
    except httpx.HTTPError as exc:
        return _failed(backend, f"{type(exc).__name__}: {exc}", started, "transport")
    except Exception as exc:
        # An odd value the parser did not foresee (block_size="inf": OverflowError) is this
        # backend's problem only: the round goes on and publishes every other backend.
        log.debug("collector: %s: unreadable metrics", backend.name, exc_info=True)
        reason = f"unreadable metrics: {type(exc).__name__}: {exc}"
        return _failed(backend, reason, started, "bad_metrics")
    return ScrapeOutcome(backend.name, report, "", time.perf_counter() - started)


def _failed(
    backend: BackendConfig, reason: str, started: float, cause: ScrapeCause
) -> ScrapeOutcome:
    return ScrapeOutcome(backend.name, None, reason, time.perf_counter() - started, cause)
