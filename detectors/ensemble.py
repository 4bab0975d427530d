"""The default univariate anomaly scorer: seasonal robust z, short level shift and distribution
change, each rank-calibrated.

Per point, three features are computed causally:

* ``|z|``, the robust z-score against the :class:`~detectors.baseline.DynamicBaseline` (level, trend,
  daily profile, spread): catches spikes and dips relative to what this time of day usually looks like;
* ``|mean(z over the last level_window points)|``: a short shift that no single point makes extreme;
* ``D``, the relative entropy of the last ``kl_window`` raw values against the deciles of the long-run
  history (:class:`~detectors.entropy.DistributionShift`): catches level shifts and regime changes that
  no single point reveals.

Each feature is calibrated against its own last ``history`` values with a conformal p-value
``p = (#{past >= now} + 1) / (n + 1)`` and mapped to ``s = -log(p) / log(history + 1)`` so scores are
comparable across signals of any unit (1.0 = more extreme than everything in the window). The ensemble
score is the maximum of the three. Alarms cost per point above threshold (NAB counts every such row), so
after a score reaches ``refractory_level`` the next ``refractory`` points are damped by ``damp``: one
incident, one high score.

Cost: O(log history) lookups plus two sorted-list inserts per point, ~70 us in CPython.
"""

from __future__ import annotations

import math
from collections import deque

from detectors.baseline import DynamicBaseline
from detectors.conformal import RankWindow
from detectors.entropy import DistributionShift
from detectors.streaming import ScorerBase


class EnsembleScorer(ScorerBase):
    """The NAB-evaluated default scorer (see the module docstring). All parameters are shared by every
    signal: nothing is tuned per series."""

    def __init__(
        self,
        history: int = 3000,
        warmup: int = 200,
        baseline_warmup: int = 50,
        level_window: int = 6,
        kl_window: int = 48,
        kl_warmup: int = 100,
        refractory: int = 200,
        refractory_level: float = 0.8,
        damp: float = 0.3,
        period_s: float = 86_400.0,
    ) -> None:
        super().__init__(warmup=warmup)
        self.history = history
        self.baseline_warmup = baseline_warmup
        self.level_window = level_window
        self.kl_window = kl_window
        self.kl_warmup = kl_warmup
        self.refractory = refractory
        self.refractory_level = refractory_level
        self.damp = damp
        self.period_s = period_s

    def _state(self) -> None:
        if not hasattr(self, "baseline_"):
            self.baseline_ = DynamicBaseline(period_s=self.period_s)
            self.z_history_ = RankWindow(self.history)
            self.level_history_ = RankWindow(self.history)
            self.recent_z_: deque[float] = deque(maxlen=max(1, self.level_window - 1))
            self.x_history_ = RankWindow(self.history)
            self.kl_history_ = RankWindow(self.history)
            self.shift_ = DistributionShift(window=self.kl_window)
            self.cooldown_ = 0
            self.learned_ = 0

    def _features(self, t: float, x: float) -> tuple[float, float, float, float | None]:
        expectation = self.baseline_.expect(t)
        # Rounded so floating-point noise (a refit on a flat line) is never mistaken for novelty.
        z = round(expectation.zscore(x), 6) if self.learned_ >= self.baseline_warmup else 0.0
        level = round(abs(sum(self.recent_z_) + z) / (len(self.recent_z_) + 1), 6)
        kl = round(self.shift_.divergence(x), 9) if self.learned_ >= self.kl_warmup else None
        return z, abs(z), level, kl

    def _calibrated(self, abs_z: float, level: float, kl: float | None) -> float:
        log_n = math.log(self.history + 1)
        score = -math.log(min(self.z_history_.p_upper(abs_z), self.level_history_.p_upper(level))) / log_n
        if kl is not None and len(self.kl_history_):
            score = max(score, -math.log(self.kl_history_.p_upper(kl)) / log_n)
        return self.damp * score if self.cooldown_ > 0 else score

    def _score(self, t: float, x: float) -> float:
        self._state()
        _, abs_z, level, kl = self._features(t, x)
        return self._calibrated(abs_z, level, kl)

    def _learn(self, t: float, x: float) -> None:
        self._update(t, x)

    def _update(self, t: float, x: float) -> float:
        self._state()
        z, abs_z, level, kl = self._features(t, x)
        score = self._calibrated(abs_z, level, kl)
        if self.cooldown_ > 0:
            self.cooldown_ -= 1
        elif score >= self.refractory_level:
            self.cooldown_ = self.refractory
        self.baseline_.learn(t, x)
        self.z_history_.add(abs_z)
        self.level_history_.add(level)
        self.recent_z_.append(z)
        self.x_history_.add(x)
        if kl is not None:
            self.kl_history_.add(kl)
        self.shift_.learn(x, self.x_history_)
        self.learned_ += 1
        return score
