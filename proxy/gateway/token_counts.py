"""The gateway's side of honest token counts: learn from answers, warn once, correct, show.

The learning is pure (``proxy.core.token_calibration``); here it meets the config (which
models have a tokenizer of their own), the log (one warning per model), ``/fleet`` and
``/metrics`` (read at scrape time: nothing is updated per request but the sums).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.config import Config
from proxy.core.token_calibration import TokenCalibration, prompt_tokens_in

log = logging.getLogger("kvroute.tokens")

#: The tokenizer the gateway counts with when none is configured (``sizing.tokenizer``).
DEFAULT_TOKENIZER = "cl100k_base"


def calibration_for(cfg: Config) -> TokenCalibration:
    """Models with a tokenizer configured are compared and shown, never corrected."""
    own = frozenset(
        name
        for name, m in cfg.models.items()
        if m.tokenizer is not None or m.tokenizer_file is not None
    )
    everywhere = cfg.sizing.tokenizer_file is not None or cfg.sizing.tokenizer != DEFAULT_TOKENIZER
    return TokenCalibration(own, everywhere)


class TokenCounts:
    """Per-model calibration of this replica's prompt counts against the servers' usage."""

    def __init__(self, cfg: Config, registry: CollectorRegistry) -> None:
        self.calibration = calibration_for(cfg)
        registry.register(_RatioCollector(self))

    def reconfigure(self, cfg: Config) -> None:
        """A reload may configure a tokenizer: what was learned stays, the correction follows."""
        fresh = calibration_for(cfg)
        self.calibration.configured = fresh.configured
        self.calibration.all_configured = fresh.all_configured

    def correct(self, model: str, prompt_tokens: int) -> int:
        return self.calibration.correct(model, prompt_tokens)

    def observe(self, model: str, counted: int, answer: bytes) -> None:
        """Compare ``counted`` (the gateway's own, uncorrected count) with the answer's usage."""
        theirs = prompt_tokens_in(answer)
        if theirs is None:
            return
        mismatch = self.calibration.observe(model, counted, theirs)
        if mismatch is None:
            return
        then = (
            f"correcting its estimates by x{mismatch.ratio:.3f} until a tokenizer is configured "
            f"(models.{model}.tokenizer_file)"
            if mismatch.corrected
            else "its configured tokenizer does not match the server's: check it"
        )
        log.warning(
            "model %s: the servers count %.0f%% %s prompt tokens than the gateway (usage."
            "prompt_tokens over %d answers); %s",
            model,
            abs(mismatch.ratio - 1.0) * 100,
            "more" if mismatch.ratio > 1 else "fewer",
            mismatch.samples,
            then,
        )

    def view(self) -> dict[str, dict[str, object]]:
        return self.calibration.view()


class _RatioCollector(Collector):
    """``kvroute_tokenizer_count_ratio{model}``: the servers' count over the gateway's."""

    def __init__(self, counts: TokenCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ratio = GaugeMetricFamily(
            "kvroute_tokenizer_count_ratio",
            "Prompt tokens the servers count (usage.prompt_tokens) per token the gateway "
            "counts, per model (1.0: the same tokenizer)",
            labels=["model"],
        )
        corrected = GaugeMetricFamily(
            "kvroute_tokenizer_correction_active",
            "1 while the gateway multiplies a model's prompt counts by the learned ratio",
            labels=["model"],
        )
        for model, (r, active) in self.counts.calibration.ratios().items():
            ratio.add_metric([model], r)
            corrected.add_metric([model], 1.0 if active else 0.0)
        yield ratio
        yield corrected
