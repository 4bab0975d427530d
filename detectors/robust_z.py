"""The simplest useful scorer: Gaussian surprise of the robust z-score against the dynamic baseline.

With ``z = (x - expected(t)) / spread`` from :class:`~detectors.baseline.DynamicBaseline`, the two-sided
tail probability is ``p = erfc(|z| / sqrt(2))`` and the score is ``min(1, -log10(p) / decades)``: with the
default ``decades = 10`` a 3-sigma point scores 0.26, 5 sigma 0.62, 7 sigma and beyond 1.0. Unlike the
ensemble it is not rank-calibrated, so its scores on a heavy-tailed signal run high; it is the readable
reference the ensemble's ``|z|`` feature comes from.
"""

from __future__ import annotations

import math

from detectors.baseline import DynamicBaseline
from detectors.streaming import ScorerBase


def gaussian_surprise(z: float, decades: float = 10.0) -> float:
    """``-log10(erfc(|z| / sqrt 2)) / decades``, clipped to [0, 1] (erfc underflows past |z| ~ 37)."""
    p = math.erfc(min(abs(z), 37.0) / math.sqrt(2.0))
    return min(1.0, -math.log10(max(p, 1e-300)) / decades)


class RobustZScorer(ScorerBase):
    """Score = Gaussian surprise of the seasonal robust z-score (see the module docstring)."""

    def __init__(self, warmup: int = 50, decades: float = 10.0, period_s: float = 86_400.0) -> None:
        super().__init__(warmup=warmup)
        self.decades = decades
        self.period_s = period_s

    def _baseline(self) -> DynamicBaseline:
        if not hasattr(self, "baseline_"):
            self.baseline_ = DynamicBaseline(period_s=self.period_s)
        return self.baseline_

    def _score(self, t: float, x: float) -> float:
        return gaussian_surprise(self._baseline().expect(t).zscore(x), self.decades)

    def _learn(self, t: float, x: float) -> None:
        self._baseline().learn(t, x)

    def _update(self, t: float, x: float) -> float:
        baseline = self._baseline()
        expectation = baseline.expect(t)
        baseline.learn(t, x, expectation)
        return gaussian_surprise(expectation.zscore(x), self.decades)
