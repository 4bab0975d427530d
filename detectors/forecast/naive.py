"""Naive baselines: the last value, and the value one season ago (daily or weekly).

They are the yardsticks every other model must beat (MASE is the ratio to a naive error), and they are
hard to beat at short horizons. Intervals are empirical: the quantiles of the model's own h-step errors
over the last ``window_s`` of history, in the (optionally log1p) space the model works in:

    last value:      yhat[t+h] = y[t],                    e_h = y[t+h] - y[t]
    seasonal naive:  yhat[t+h] = y[t+h-m*ceil(h/m)],      e   = y[t] - y[t-m]   (same for every h <= m)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from detectors.forecast.base import DEFAULT_QUANTILES, BaseForecaster, Transform, empirical_quantiles
from detectors.forecast.series import FloatArray

DAY_S = 86_400.0
WEEK_S = 7 * DAY_S


class _HistoryForecaster(BaseForecaster):
    """Keeps a bounded tail of (transformed) history; subclasses forecast from it."""

    def __init__(
        self,
        *,
        log: bool = False,
        window_s: float = DAY_S,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        max_gap_steps: int = 5,
    ) -> None:
        super().__init__(quantiles, max_gap_steps)
        self.log = log
        self.window_s = window_s

    def _window_steps(self) -> int:
        return max(2, round(self.window_s / self.step_s_))

    def _keep_steps(self) -> int:
        return self._window_steps() + 1

    def _fit(self, values: FloatArray) -> None:
        self.transform_ = Transform(self.log)
        self.history_ = self.transform_.forward(values)[-self._keep_steps() :].copy()

    def _extend(self, values: FloatArray) -> None:
        joined = np.concatenate((self.history_, self.transform_.forward(values)))
        self.history_ = joined[-self._keep_steps() :]


class LastValue(_HistoryForecaster):
    """Random walk: tomorrow looks like now. Wins when the level drifts and there is no usable season."""

    name = "last_value"
    min_history = 2

    def _keep_steps(self) -> int:
        return self._window_steps() + 120  # room for h-step differences up to two hours

    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]:
        y = self.history_
        point = np.full(steps, y[-1])
        usable = min(steps, len(y) - 1)
        window = min(self._window_steps(), len(y) - usable)
        # residuals[i, h-1] = y[s+i+h] - y[s+i] for the last `window` origins s+i that have y[s+i+h].
        origins = np.arange(len(y) - usable - window, len(y) - usable)
        horizons = np.minimum(np.arange(1, steps + 1), usable)
        residuals = y[origins[:, None] + horizons[None, :]] - y[origins[:, None]]
        quantiles = empirical_quantiles(point, residuals, self.quantiles)
        return self.transform_.inverse(point), {q: self.transform_.inverse(v) for q, v in quantiles.items()}


class SeasonalNaive(_HistoryForecaster):
    """Same time one season ago. ``period_s`` is a day (``seasonal_naive_1d``) or a week (``..._1w``)."""

    def __init__(
        self,
        period_s: float = DAY_S,
        *,
        log: bool = False,
        window_s: float = DAY_S,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        max_gap_steps: int = 5,
    ) -> None:
        super().__init__(log=log, window_s=window_s, quantiles=quantiles, max_gap_steps=max_gap_steps)
        self.period_s = period_s
        self.name = "seasonal_naive_1w" if period_s == WEEK_S else f"seasonal_naive_{period_s / DAY_S:g}d"

    @property
    def period_steps(self) -> int:
        return max(1, round(self.period_s / self.step_s_))

    def _fit(self, values: FloatArray) -> None:
        if len(values) < self.period_steps:
            raise ValueError(
                f"{self.name} needs one full season ({self.period_steps} points), got {len(values)}"
            )
        super()._fit(values)

    def _keep_steps(self) -> int:
        return self.period_steps + self._window_steps()

    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]:
        y, m = self.history_, self.period_steps
        h = np.arange(1, steps + 1)
        point = y[len(y) - 1 + h - m * np.ceil(h / m).astype(np.int64)]
        residuals = y[m:] - y[:-m]
        quantiles = empirical_quantiles(point, residuals[-self._window_steps() :], self.quantiles)
        return self.transform_.inverse(point), {q: self.transform_.inverse(v) for q, v in quantiles.items()}
