"""Restart hooks: how the maintenance loop restarts one backend's inference process.

``http``: one request (method, URL, headers; ``{name}`` and ``{url}`` filled in), success on
2xx. ``command``: a program run with an argv list, never through a shell, success on exit 0.
``kubernetes``: delete the backend's pod (named like the backend, as discovery names them)
through the API, then wait for its ReplicaSet's replacement to be Running and Ready;
``replaced_by`` names it, and the maintenance loop waits for that pod to report a fresh
allocator before the next restart. ``none``: no hook, advise only. Each call has a timeout and never raises: a failure comes
back as a ``HookResult`` with ``ok=False`` and the reason.

A result has two texts: ``summary`` (exit code, HTTP status, timeout: no output, no URL)
goes into the open event log (``/fleet/events``); ``detail`` (a command's output, an HTTP
hook's target and response body, URL credentials redacted) goes to the gateway's log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from proxy.config import RestartHookConfig
from proxy.core.redact import redact
from proxy.ops.restart_contract import HookResult as HookResult
from proxy.ops.restart_contract import RestartHook as RestartHook
from proxy.ops.restart_kubernetes import KubernetesHook
from proxy.upstream.tls import verifying_context

OUTPUT_LIMIT = 2_000  # characters of a command's output or an HTTP body kept for the log


def fill(template: str, name: str, url: str) -> str:
    """Replace ``{name}`` and ``{url}``; nothing else is interpreted (no str.format)."""
    return template.replace("{name}", name).replace("{url}", url)


class NoHook(RestartHook):
    kind = "none"

    async def restart(self, name: str, url: str) -> HookResult:
        return HookResult(False, "no restart hook configured (maintenance.hook.type: none)")


class HttpHook(RestartHook):
    kind = "http"

    def __init__(self, method: str, url: str, headers: dict[str, str], timeout_s: float) -> None:
        self.method = method.upper()
        self.url = url
        self.headers = dict(headers)
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None

    async def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # The shared context, built off the loop (proxy.upstream.tls).
            tls = await verifying_context()
            if self._client is None:
                # trust_env=False: the hook goes where the config says, not through an environment proxy.
                self._client = httpx.AsyncClient(
                    timeout=httpx.Timeout(self.timeout_s),
                    trust_env=False,
                    follow_redirects=False,
                    verify=tls,
                )
        return self._client

    async def restart(self, name: str, url: str) -> HookResult:
        target = fill(self.url, name, url)
        headers = {k: fill(v, name, url) for k, v in self.headers.items()}
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await (await self._http()).request(self.method, target, headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            return HookResult(
                False,
                redact(f"{self.method} {target}: timeout after {self.timeout_s:g}s"),
                time.monotonic() - t0,
                f"http hook: timeout after {self.timeout_s:g}s",
            )
        except httpx.HTTPError as exc:
            return HookResult(
                False,
                redact(f"{self.method} {target}: {type(exc).__name__}: {exc}"),
                time.monotonic() - t0,
                f"http hook: {type(exc).__name__}",
            )
        body = resp.text[:OUTPUT_LIMIT]
        ok = 200 <= resp.status_code < 300
        return HookResult(
            ok,
            redact(f"{self.method} {target}: HTTP {resp.status_code} {body}".strip()),
            time.monotonic() - t0,
            f"http hook: HTTP {resp.status_code}",
        )

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


class CommandHook(RestartHook):
    kind = "command"

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        if not argv:
            raise ValueError("a command hook needs a non-empty argv")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    async def restart(self, name: str, url: str) -> HookResult:
        argv = [fill(a, name, url) for a in self.argv]
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            return HookResult(
                False,
                redact(f"cannot run {argv[0]!r}: {exc.strerror or exc}"),
                time.monotonic() - t0,
                f"command hook: cannot run ({exc.strerror or type(exc).__name__})",
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                out, _ = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return HookResult(
                False,
                redact(f"{argv[0]}: timeout after {self.timeout_s:g}s (killed)"),
                time.monotonic() - t0,
                f"command hook: timeout after {self.timeout_s:g}s (killed)",
            )
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        text = out.decode("utf-8", errors="replace")[-OUTPUT_LIMIT:].strip()
        rc = proc.returncode
        return HookResult(
            rc == 0,
            redact(f"{argv[0]}: exit {rc} {text}".strip()),
            time.monotonic() - t0,
            f"command hook: exit {rc}",
        )


def make_hook(cfg: RestartHookConfig) -> RestartHook:
    if cfg.type == "kubernetes":
        assert cfg.pod_selector is not None  # the config model requires it
        return KubernetesHook(cfg.kubernetes, cfg.pod_selector, cfg.timeout_s)
    if cfg.type == "http":
        assert cfg.url is not None  # the config model requires it
        return HttpHook(cfg.method, cfg.url, cfg.headers, cfg.timeout_s)
    if cfg.type == "command":
        return CommandHook(cfg.argv, cfg.timeout_s)
    return NoHook()
