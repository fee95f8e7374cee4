"""The configured discovery source, built from the config.

Apart from ``discovery`` (the contract every source implements) so that the sources, which
import the contract, and the factory, which imports the sources, form no import circle.
"""

from __future__ import annotations

from proxy.backends.discovery import Discovery
from proxy.backends.discovery_dns import DnsDiscovery
from proxy.backends.discovery_inferencepool import InferencePoolDiscovery
from proxy.backends.discovery_kubernetes import KubernetesDiscovery
from proxy.config import Config


def make_discovery(cfg: Config) -> Discovery | None:
    """The configured source, or None for ``static`` (nothing to follow)."""
    d = cfg.discovery
    if d.type == "kubernetes":
        return KubernetesDiscovery(d, cfg.backends, set(cfg.pools))
    if d.type == "inferencepool":
        return InferencePoolDiscovery(d, cfg.backends, set(cfg.pools))
    if d.type == "dns":
        return DnsDiscovery(d, cfg.backends)
    return None
