"""DNS discovery: the addresses behind a name, for fleets outside Kubernetes (or headless
Services without API access).

With ``discovery.port`` set, the name's A and AAAA records are the backends (``ip:port``);
without it, the name's SRV records give host and port, and each host is resolved to its
addresses. Resolved every ``interval_s`` through dnspython's async resolver (the system's
``/etc/resolv.conf``; tests pass one pointed at their own server), never blocking the loop.
A failed resolution keeps the current list: a DNS hiccup must not empty the fleet.
"""

from __future__ import annotations

import asyncio

import dns.asyncresolver
import dns.exception
import dns.resolver

from proxy.backends.discovery import Discovery, backend
from proxy.config import BackendConfig, DiscoveryConfig

RESOLVE_TIMEOUT_S = 5.0


class DnsDiscovery(Discovery):
    def __init__(
        self,
        cfg: DiscoveryConfig,
        static: list[BackendConfig],
        resolver: dns.asyncresolver.Resolver | None = None,
    ) -> None:
        super().__init__(cfg, static)
        if resolver is None:
            resolver = dns.asyncresolver.Resolver()
        resolver.lifetime = RESOLVE_TIMEOUT_S
        self.resolver = resolver

    async def _addresses(self, host: str) -> list[str]:
        found: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(host, rdtype)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                continue
            found.extend(r.to_text() for r in answer)
        return found

    async def resolve(self) -> list[BackendConfig]:
        name = self.cfg.name
        assert name is not None  # the config model requires it for dns
        if isinstance(self.cfg.port, int):
            port = self.cfg.port
            return [
                backend(self.cfg, f"{ip}:{port}", ip, port) for ip in await self._addresses(name)
            ]
        out: dict[str, BackendConfig] = {}
        answer = await self.resolver.resolve(name, "SRV")
        for srv in sorted(answer, key=lambda r: (r.priority, -r.weight, str(r.target))):
            host = str(srv.target).rstrip(".")
            # A headless Service's SRV targets start with the pod's name: the readable part.
            label = host.split(".", 1)[0]
            for ip in await self._addresses(host):
                key = f"{label}:{srv.port}"
                if key in out:
                    key = f"{label}-{ip}:{srv.port}"
                out[key] = backend(self.cfg, key, ip, int(srv.port))
        return list(out.values())

    async def first_list(self) -> None:
        self.publish(await self.resolve())

    async def _run(self) -> None:
        await asyncio.sleep(self.cfg.interval_s)
        try:
            self.publish(await self.resolve())
        except dns.resolver.NXDOMAIN:
            # The name itself is gone (e.g. the Service was deleted): no backends left.
            self.publish([])
        except dns.exception.DNSException as exc:
            raise RuntimeError(f"dns {self.cfg.name}: {type(exc).__name__}: {exc}") from exc
