"""Dynamic baselines: what a signal "normally" is at time t, with a robust spread around it.

Model, per signal::

    x_t = level_t + s(phase(t)) + e_t,     phase(t) = (t mod period_s) / step_s   (daily by default)

* **Streaming path** (every point, O(1)): score first, then learn. With the residual
  ``r = x - level - s(phase)`` the level follows the trend by an EWMA whose innovation is clipped at
  ``clip * spread`` (Huber), ``level += alpha * clip(x - s - level)``; the seasonal bin learns
  ``s(phase) += gamma * (x - level - s(phase))``; the spread is an EWMA of
  ``1.2533 * min(|r|, clip * spread)`` (1.2533 = sqrt(pi/2) turns a mean absolute deviation into a normal
  sigma; clipping keeps one outlier from blowing it up).
* **Periodic refit** (once per ``refit_every_s`` of data time, once two periods are buffered): the
  buffered history is winsorised at ``outlier_mads`` MADs, averaged onto a regular grid of at most
  ``coarse_bins`` points per period (keeps STL at ~10 ms) and decomposed with statsmodels' STL for the
  trend. The seasonal strength is measured out of sample on the detrended grid,
  ``F = max(0, 1 - Var(last period - profile of earlier periods) / Var(last period))`` (Wang, Smith &
  Hyndman's in-sample ``1 - Var(R) / Var(S + R)`` calls white noise ~70 % seasonal over a few periods).
  If ``F >= min_strength`` the native-resolution profile is re-estimated as the per-phase median of the
  detrended history, else the profile is dropped. Level and spread restart from the STL trend and
  ``1.4826 * MAD`` of the remainder.

``z = (x - expected) / spread`` is the robust z-score the scorers use. Time may step back or repeat;
gaps only mean fewer points per phase bin.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

SQRT_HALF_PI = math.sqrt(math.pi / 2.0)
MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class Expectation:
    """The baseline's view of time ``t``: expected value, robust spread (sigma) and seasonal part."""

    center: float
    spread: float
    seasonal: float

    def zscore(self, x: float) -> float:
        return (x - self.center) / self.spread


class DynamicBaseline:
    """Robust level + spread following trend and daily seasonality; see the module docstring."""

    def __init__(
        self,
        period_s: float = 86_400.0,
        alpha: float = 0.05,
        gamma: float = 0.1,
        spread_alpha: float = 0.02,
        clip: float = 4.0,
        history_periods: float = 7.0,
        max_history: int = 4096,
        refit_every_s: float = 86_400.0,
        coarse_bins: int = 48,
        min_strength: float = 0.6,
        seasonal_smoother: int = 15,
        outlier_mads: float = 10.0,
        rel_spread_floor: float = 1e-3,
    ) -> None:
        self.period_s = period_s
        self.alpha = alpha
        self.gamma = gamma
        self.spread_alpha = spread_alpha
        self.clip = clip
        self.history_periods = history_periods
        self.max_history = max_history
        self.refit_every_s = refit_every_s
        self.coarse_bins = coarse_bins
        self.min_strength = min_strength
        self.seasonal_smoother = seasonal_smoother
        self.outlier_mads = outlier_mads
        self.rel_spread_floor = rel_spread_floor
        self.level_: float | None = None
        self.spread_ = 0.0
        self.scale_ = 0.0
        self.step_: float | None = None
        self.profile_: list[float] | None = None
        self.strength_ = 0.0
        self.next_refit_t_: float | None = None
        self.refits_ = 0
        self._times: deque[float] = deque(maxlen=max_history)
        self._values: deque[float] = deque(maxlen=max_history)

    # -- reading ------------------------------------------------------------------------------------
    def _bin(self, t: float) -> int:
        assert self.step_ is not None and self.profile_ is not None
        return int((t % self.period_s) // self.step_) % len(self.profile_)

    def expect(self, t: float) -> Expectation:
        """Expected value and spread at ``t`` from what was learned so far (no state change)."""
        level = 0.0 if self.level_ is None else self.level_
        seasonal = self.profile_[self._bin(t)] if self.profile_ is not None else 0.0
        # The floor keeps z finite on constant series while still flagging any change of a flat line.
        floor = self.rel_spread_floor * max(self.scale_, 1e-9)
        return Expectation(level + seasonal, max(self.spread_, floor), seasonal)

    # -- learning -----------------------------------------------------------------------------------
    def learn(self, t: float, x: float, expectation: Expectation | None = None) -> None:
        """Fold ``(t, x)`` in; pass the :meth:`expect` result for ``t`` to avoid computing it twice."""
        if self.level_ is None:
            self.level_, self.next_refit_t_ = x, t + self.refit_every_s
        else:
            e = expectation or self.expect(t)
            residual = abs(x - e.center)
            bounded = residual if self.spread_ == 0.0 else min(residual, self.clip * self.spread_)
            self.spread_ += self.spread_alpha * (SQRT_HALF_PI * bounded - self.spread_)
            innovation = x - e.seasonal - self.level_
            if self.spread_ > 0.0:  # Huber-style: one spike must not drag the level for hours
                innovation = max(-self.clip * self.spread_, min(self.clip * self.spread_, innovation))
            self.level_ += self.alpha * innovation
            if self.profile_ is not None:
                b = self._bin(t)
                self.profile_[b] += self.gamma * (x - self.level_ - self.profile_[b])
        self.scale_ += 0.01 * (abs(x) - self.scale_) if self.scale_ else abs(x)
        if self.step_ is None and self._times and t > self._times[-1]:
            self.step_ = t - self._times[-1]
        self._times.append(t)
        self._values.append(x)
        self._drop_old(t)
        assert self.next_refit_t_ is not None
        if t >= self.next_refit_t_:
            self.next_refit_t_ = t + self.refit_every_s
            self.refit()

    def _drop_old(self, t: float) -> None:
        horizon = t - self.history_periods * self.period_s
        while self._times and self._times[0] < horizon:
            self._times.popleft()
            self._values.popleft()

    @staticmethod
    def _holdout_strength(detrended: np.ndarray, per_period: int) -> float:
        """Out-of-sample seasonal strength: how much of the last period's variance the phase profile of
        the earlier periods explains, ``max(0, 1 - Var(last - profile) / Var(last))``. On noise the
        profile explains nothing (< 0 -> 0), however few periods there are; in-sample measures say ~0.7."""
        last = detrended[-per_period:]
        earlier = detrended[: (detrended.size - per_period) // per_period * per_period]
        variance = float(np.var(last))
        if earlier.size < per_period or variance <= 0.0:
            return 0.0
        # Align earlier periods with the last one, which may start at any phase of the grid.
        shift = (detrended.size - per_period) % per_period
        profile = np.roll(earlier.reshape(-1, per_period).mean(axis=0), -shift)
        return max(0.0, 1.0 - float(np.var(last - profile)) / variance)

    def refit(self) -> None:
        """Re-estimate profile, level and spread from the buffer with STL (see the module docstring)."""
        times = np.fromiter(self._times, dtype=np.float64)
        values = np.fromiter(self._values, dtype=np.float64)
        if times.size < 16 or times.max() - times.min() < 2.0 * self.period_s:
            return
        diffs = np.diff(times)
        step = float(np.median(diffs[diffs > 0])) if np.any(diffs > 0) else 0.0
        if step <= 0.0 or step > self.period_s / 4.0:
            return
        from statsmodels.tsa.seasonal import STL  # lazy: heavy import, needed only here

        # Winsorise first: one 1e6 spike must not bend the trend, the profile or the spread of a week.
        center = float(np.median(values))
        mad = float(np.median(np.abs(values - center)))
        if mad > 0.0:
            values = np.clip(values, center - self.outlier_mads * mad, center + self.outlier_mads * mad)

        per_period = min(self.coarse_bins, round(self.period_s / step))
        coarse_step = self.period_s / per_period
        origin = times.min() - times.min() % self.period_s
        slot = ((times - origin) // coarse_step).astype(np.int64)
        n_slots = int(slot.max()) + 1
        sums = np.bincount(slot, weights=values, minlength=n_slots)
        counts = np.bincount(slot, minlength=n_slots)
        filled = counts > 0
        grid = np.interp(np.arange(n_slots), np.flatnonzero(filled), sums[filled] / counts[filled])
        fit = STL(grid, period=per_period, seasonal=self.seasonal_smoother, robust=False).fit()
        self.strength_ = self._holdout_strength(grid - fit.trend, per_period)
        trend = np.interp((times - origin) / coarse_step - 0.5, np.arange(n_slots), fit.trend)
        detrended = values - trend
        self.step_ = step
        if self.strength_ >= self.min_strength:
            n_bins = max(1, round(self.period_s / step))
            phase = ((times % self.period_s) // step).astype(np.int64) % n_bins
            coarse_season = np.interp(
                np.arange(n_bins) * step / coarse_step, np.arange(n_slots), fit.seasonal
            )
            profile = coarse_season.copy()
            for b in np.unique(phase):
                profile[b] = np.median(detrended[phase == b])
            self.profile_ = [float(v) for v in profile - profile.mean()]
            remainder = detrended - (profile - profile.mean())[phase]
        else:
            self.profile_ = None
            remainder = detrended
        mad = float(np.median(np.abs(remainder - np.median(remainder))))
        self.spread_ = max(MAD_TO_SIGMA * mad, 0.5 * self.spread_)
        self.level_ = float(trend[-1])
        self.refits_ += 1
