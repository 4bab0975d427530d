"""Statistical models from statsmodels: Holt-Winters seasonal exponential smoothing and ARIMA.

**Holt-Winters** is ETS(A,N,A) (additive level and season, no trend: over minutes to an hour a trend term
only extrapolates noise), fitted in log1p space when ``log=True`` so the daily cycle acts as a ratio.
statsmodels estimates the smoothing weights and the initial states; between refits the state is carried
forward with the standard error-correction recursions, so an update costs O(new points) rather than a
refit over a week of minutes::

    e_t = y_t - l_{t-1} - s_{t-m}
    l_t = l_{t-1} + alpha * e_t
    s_t = s_{t-m} + gamma * e_t          # == gamma*(y_t - l_{t-1}) + (1-gamma)*s_{t-m}
    yhat_{t+h} = l_t + s_{t+h-m*ceil(h/m)}
    Var(e_{t+h}) = sigma^2 * (1 + (h-1) * alpha^2)     for h <= m

``sigma`` is the spread of the recent one-step errors (last ``window_s``, at least 100 of them), so
intervals widen at busy times and narrow at quiet ones as the data do.

**ARIMA** is a non-seasonal SARIMAX (a daily season at a 1-minute step would need a 1,440-dimensional
state); updates use ``results.extend`` so the Kalman state moves forward without refitting.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from detectors.forecast.base import DEFAULT_QUANTILES, BaseForecaster, Transform, gaussian_quantiles
from detectors.forecast.naive import DAY_S
from detectors.forecast.series import FloatArray


class HoltWinters(BaseForecaster):
    """Seasonal exponential smoothing (ETS(A,N,A)) with statsmodels-estimated weights."""

    name = "holt_winters"

    def __init__(
        self,
        period_s: float = DAY_S,
        *,
        log: bool = False,
        window_s: float = DAY_S / 4,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        max_gap_steps: int = 5,
    ) -> None:
        super().__init__(quantiles, max_gap_steps)
        self.period_s = period_s
        self.log = log
        self.window_s = window_s

    def _fit(self, values: FloatArray) -> None:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        self.period_steps_ = max(2, round(self.period_s / self.step_s_))
        if len(values) < 2 * self.period_steps_:
            raise ValueError(
                f"{self.name} needs two full seasons ({2 * self.period_steps_} points), got {len(values)}"
            )
        self.transform_ = Transform(self.log)
        y = self.transform_.forward(values)
        model = ExponentialSmoothing(
            y, seasonal="add", seasonal_periods=self.period_steps_, initialization_method="heuristic"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter; the fitted weights are checked below
            result = model.fit(optimized=True)
        self.alpha_ = float(np.clip(result.params["smoothing_level"], 0.0, 1.0))
        self.gamma_ = float(np.clip(result.params["smoothing_seasonal"], 0.0, 1.0))
        self.level_ = float(result.level[-1])
        self.season_ = np.asarray(result.season[-self.period_steps_ :], dtype=np.float64).copy()
        window = max(100, round(self.window_s / self.step_s_))  # fewer residuals make sigma noisy
        self.residuals_ = np.asarray(result.resid[-window:], dtype=np.float64).copy()
        self._window = window

    def _extend(self, values: FloatArray) -> None:
        level, season, alpha, gamma = self.level_, self.season_, self.alpha_, self.gamma_
        errors = np.empty(len(values))
        for i, y in enumerate(self.transform_.forward(values)):
            s_old = season[0]
            error = y - level - s_old
            level = level + alpha * error
            season = np.roll(season, -1)
            season[-1] = s_old + gamma * error
            errors[i] = error
        self.level_, self.season_ = level, season
        self.residuals_ = np.concatenate((self.residuals_, errors))[-self._window :]

    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]:
        m = self.period_steps_
        h = np.arange(1, steps + 1)
        point = self.level_ + self.season_[(h - 1) % m]
        sigma = float(np.std(self.residuals_)) * np.sqrt(1 + (h - 1) * self.alpha_**2)
        quantiles = gaussian_quantiles(point, sigma, self.quantiles)
        return self.transform_.inverse(point), {q: self.transform_.inverse(v) for q, v in quantiles.items()}


class Arima(BaseForecaster):
    """ARIMA(p, d, q) via statsmodels' SARIMAX, fitted on the last ``fit_window_s`` of history."""

    name = "arima"
    min_history = 30

    def __init__(
        self,
        order: tuple[int, int, int] = (2, 1, 1),
        *,
        log: bool = False,
        fit_window_s: float = DAY_S,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        max_gap_steps: int = 5,
    ) -> None:
        super().__init__(quantiles, max_gap_steps)
        self.order = order
        self.log = log
        self.fit_window_s = fit_window_s

    def _fit(self, values: FloatArray) -> None:
        from statsmodels.tsa.statespace.sarimax import SARIMAX

        self.transform_ = Transform(self.log)
        window = max(self.min_history, round(self.fit_window_s / self.step_s_))
        y = self.transform_.forward(values)[-window:]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.result_: Any = SARIMAX(y, order=self.order).fit(disp=False)

    def _extend(self, values: FloatArray) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.result_ = self.result_.extend(self.transform_.forward(values))

    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]:
        prediction = self.result_.get_forecast(steps)
        point = np.asarray(prediction.predicted_mean, dtype=np.float64)
        sigma = np.nan_to_num(np.asarray(prediction.se_mean, dtype=np.float64), nan=0.0)
        quantiles = gaussian_quantiles(point, sigma, self.quantiles)
        return self.transform_.inverse(point), {q: self.transform_.inverse(v) for q, v in quantiles.items()}
