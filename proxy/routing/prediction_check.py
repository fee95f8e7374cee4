"""A model that checks itself: each queueing backend's predicted TTFT against the observed one.

The ranking and the hold on queueing servers (vLLM, SGLang, TGI) rest on a model of the
engine: a prefill rate, a decode rate, a slot limit, the projected KV peak
(``proxy.routing.queueing.expected_wait_s``). It was tuned on the simulated engine in this
repository, and on an independent engine it lost to a random pick of two (issue 53). A model
that is wrong does more harm than no model, so every streamed request placed on a queueing
backend records what the model predicted for its first token and what happened.

**A miss** is an observation off its prediction by more than ``ratio`` times *and* by more
than ``floor_s`` seconds (both ways: a wait the model does not see ranks badly; a wait it
sees where there is none holds requests for nothing; the floor keeps sub-second noise from
counting). Over the last ``window`` predictions fleet-wide, when more than
``fall_back_above`` of them missed (at least ``min_samples`` seen), the gateway stops
trusting the model: the ranking of queueing nodes becomes least outstanding requests, then
tokens (what a blind router does, fit kept), and nothing is held on a prediction. Predictions
are still made and checked meanwhile; when the share of misses falls to ``return_below``,
the model is trusted again (hysteresis: no flapping on one request).

Pure: the gateway (``proxy.gateway.ttft_check``) feeds it and exports what it shows.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# Observations a backend needs before its median bounds a hold.
MIN_OBSERVED = 5


@dataclass(frozen=True, slots=True)
class CheckSettings:
    ratio: float = 3.0
    floor_s: float = 0.5
    window: int = 60
    min_samples: int = 20
    fall_back_above: float = 0.5
    return_below: float = 0.25


def is_miss(predicted_s: float, observed_s: float, s: CheckSettings) -> bool:
    """The observation is off the prediction by more than the ratio and the floor."""
    if abs(observed_s - predicted_s) <= s.floor_s:
        return False
    low, high = sorted((max(predicted_s, 1e-6), max(observed_s, 1e-6)))
    return high / low > s.ratio


@dataclass(slots=True)
class BackendRecord:
    """One backend's predictions as checked: counts, the last pair, the recent miss share."""

    checked: int = 0
    misses: int = 0
    last_predicted_s: float = 0.0
    last_observed_s: float = 0.0
    # Sum of observed - predicted (seconds): its mean says which way the model is off.
    error_sum_s: float = 0.0
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=60))
    observed: deque[float] = field(default_factory=lambda: deque(maxlen=60))

    def to_json(self) -> dict[str, object]:
        recent = list(self.recent)
        return {
            "checked": self.checked,
            "misses": self.misses,
            "recent_miss_share": round(sum(recent) / len(recent), 3) if recent else None,
            "mean_error_s": round(self.error_sum_s / self.checked, 3) if self.checked else None,
            "last_predicted_s": round(self.last_predicted_s, 3),
            "last_observed_s": round(self.last_observed_s, 3),
        }


@dataclass
class PredictionCheck:
    """Predictions checked fleet-wide and per backend; ``blind`` while they miss."""

    settings: CheckSettings = field(default_factory=CheckSettings)
    blind: bool = False
    # Times the ranking fell back (for the metric and /fleet).
    fallbacks: int = 0
    backends: dict[str, BackendRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._recent: deque[bool] = deque(maxlen=self.settings.window)

    def miss_share(self) -> float | None:
        """Share of the recent predictions that missed (None: none yet)."""
        return sum(self._recent) / len(self._recent) if self._recent else None

    def observe(self, backend: str, predicted_s: float, observed_s: float) -> bool:
        """Check one prediction; True when it missed. May turn ``blind`` on or off."""
        miss = is_miss(predicted_s, observed_s, self.settings)
        rec = self.backends.get(backend)
        if rec is None:
            window = self.settings.window
            rec = self.backends[backend] = BackendRecord(
                recent=deque(maxlen=window), observed=deque(maxlen=window)
            )
        rec.checked += 1
        rec.misses += miss
        rec.last_predicted_s, rec.last_observed_s = predicted_s, observed_s
        rec.error_sum_s += observed_s - predicted_s
        rec.recent.append(miss)
        rec.observed.append(observed_s)
        self._recent.append(miss)
        self._update()
        return miss

    def observed_median(self, backend: str) -> float | None:
        """The median observed TTFT of ``backend``'s recent streams (None: fewer than a few)."""
        rec = self.backends.get(backend)
        if rec is None or len(rec.observed) < MIN_OBSERVED:
            return None
        return statistics.median(rec.observed)

    def _update(self) -> None:
        s, share = self.settings, self.miss_share()
        if share is None or len(self._recent) < s.min_samples:
            return
        if not self.blind and share > s.fall_back_above:
            self.blind = True
            self.fallbacks += 1
        elif self.blind and share <= s.return_below:
            self.blind = False

    def to_json(self) -> dict[str, object]:
        share = self.miss_share()
        s = self.settings
        return {
            "ranking": "blind" if self.blind else "model",
            "recent_miss_share": round(share, 3) if share is not None else None,
            "recent": len(self._recent),
            "fallbacks": self.fallbacks,
            "rule": (
                f"a miss: off by more than {s.ratio:g}x and {s.floor_s:g}s; blind above "
                f"{s.fall_back_above:g} of the last {s.window} (at least {s.min_samples}), "
                f"back at {s.return_below:g}"
            ),
            "backends": {name: rec.to_json() for name, rec in sorted(self.backends.items())},
        }
