"""Rolling-origin backtests with MASE and sMAPE, and no lookahead.

A forecaster is fitted on ``series[:initial]``; then for every origin ``o = initial, initial + stride, ...``
it is shown exactly ``series[:o]`` (by ``extend``, or by a refit every ``refit_every`` steps) and asked for
``max(horizons)`` steps. Nothing at or after ``o`` is ever passed to it before it forecasts from ``o``.

For a horizon of ``h`` steps the errors are averaged over the whole path ``o .. o+h-1`` and all origins:

    MASE_h  = mean |y - yhat| / scale,   scale = mean |y_t - y_{t-1}| over series[:initial]
    sMAPE_h = mean 2 |y - yhat| / (|y| + |yhat|)          (a fraction in [0, 2]; 0/0 counts as 0)

``scale`` is the in-sample *one-step* naive error of the initial training window and is shared by every
model, so MASE ratios between models equal MAE ratios; a 30-minute MASE above 1 is expected (the
one-step naive error is the bar for a one-minute-ahead forecast).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from detectors.forecast.base import Forecaster
from detectors.forecast.series import FloatArray, Series


@dataclass(frozen=True, eq=False)
class BacktestResult:
    """Forecast paths of one model at every origin, and the actual values to score them against.

    ``mean`` and each ``quantiles[q]`` are ``(origins, max_h)``; ``actual`` likewise. ``error`` is set
    (and the arrays are empty) when the model could not be fitted, e.g. too little history for a weekly
    season.
    """

    name: str
    step_s: float
    origins: NDArray[np.int64]
    actual: FloatArray
    mean: FloatArray
    quantiles: dict[float, FloatArray] = field(default_factory=dict)
    scale: float = 1.0
    fit_s: float = 0.0
    forecast_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.origins.size > 0

    def mase(self, steps: int) -> float:
        return float(np.mean(np.abs(self.actual[:, :steps] - self.mean[:, :steps]))) / self.scale

    def smape(self, steps: int) -> float:
        y, f = self.actual[:, :steps], self.mean[:, :steps]
        denominator = np.abs(y) + np.abs(f)
        ratio = np.divide(2 * np.abs(y - f), denominator, out=np.zeros_like(y), where=denominator > 0)
        return float(np.mean(ratio))

    def window(
        self, first: int | None = None, stop: int | None = None, name: str | None = None
    ) -> BacktestResult:
        """The same backtest restricted to origins in ``[first, stop)`` (series indices). Selection uses
        an earlier window than the one reported, so the winner is not scored on the data that chose it."""
        keep = np.ones(self.origins.shape, dtype=np.bool_)
        if first is not None:
            keep &= self.origins >= first
        if stop is not None:
            keep &= self.origins < stop
        return BacktestResult(
            name or self.name,
            self.step_s,
            self.origins[keep],
            self.actual[keep],
            self.mean[keep],
            {q: v[keep] for q, v in self.quantiles.items()},
            self.scale,
            self.fit_s,
            self.forecast_s,
            self.error,
        )

    def coverage(self, steps: int, low: float = 0.1, high: float = 0.9) -> float:
        """Share of actual values inside the [low, high] quantile band over steps 1..``steps``."""
        y = self.actual[:, :steps]
        inside = (y >= self.quantiles[low][:, :steps]) & (y <= self.quantiles[high][:, :steps])
        return float(np.mean(inside))


def naive_scale(values: FloatArray) -> float:
    """In-sample one-step naive MAE (the MASE denominator); 1.0 for a constant series."""
    scale = float(np.mean(np.abs(np.diff(values)))) if len(values) > 1 else 0.0
    return scale if scale > 0 else 1.0


def rolling_origin(
    factory: Callable[[], Forecaster],
    series: Series,
    *,
    horizon: int,
    initial: int,
    stride: int = 1,
    refit_every: int | None = None,
    name: str | None = None,
) -> BacktestResult:
    """Backtest ``factory()`` on ``series`` (gap-free) from ``initial`` to the end; see the module doc."""
    values = series.require_complete()
    if not 0 < initial <= len(values) - horizon:
        raise ValueError(
            f"initial={initial} leaves no room for a {horizon}-step forecast in {len(values)} points"
        )
    origins = np.arange(initial, len(values) - horizon + 1, max(1, stride), dtype=np.int64)
    forecaster = factory()
    label = name or forecaster.name
    scale = naive_scale(values[:initial])
    empty = np.zeros((0, horizon))
    started = time.perf_counter()
    try:
        forecaster.fit(series.head(initial))
    except ValueError as error:
        return BacktestResult(label, series.step_s, origins[:0], empty, empty, scale=scale, error=str(error))
    fit_s, forecast_s = time.perf_counter() - started, 0.0
    means, bands, seen, last_fit = [], [], initial, initial
    for origin in origins:
        started = time.perf_counter()
        if refit_every and origin - last_fit >= refit_every:
            forecaster.fit(series.head(int(origin)))
            last_fit = int(origin)
        else:
            forecaster.extend(values[seen:origin])
        seen = int(origin)
        fit_s += time.perf_counter() - started
        started = time.perf_counter()
        result = forecaster.forecast(horizon)
        forecast_s += time.perf_counter() - started
        means.append(result.mean)
        bands.append(result.quantiles)
    actual = values[origins[:, None] + np.arange(horizon)[None, :]]
    quantiles = {q: np.array([band[q] for band in bands]) for q in bands[0]} if bands else {}
    return BacktestResult(
        label, series.step_s, origins, actual, np.array(means), quantiles, scale, fit_s, forecast_s
    )


def combine(results: Sequence[BacktestResult], name: str | None = None) -> BacktestResult:
    """The equal-weight ensemble of already backtested models: mean of the point paths and of each
    quantile (Vincentisation). Costs nothing extra, since every member's paths are stored."""
    if not results or any(not r.ok for r in results):
        raise ValueError("combine needs successful backtests")
    first = results[0]
    if any(not np.array_equal(r.origins, first.origins) for r in results):
        raise ValueError("combine needs backtests over the same origins")
    levels = set.intersection(*(set(r.quantiles) for r in results))
    return BacktestResult(
        name or "ensemble(" + "+".join(r.name for r in results) + ")",
        first.step_s,
        first.origins,
        first.actual,
        np.mean([r.mean for r in results], axis=0),
        {q: np.mean([r.quantiles[q] for r in results], axis=0) for q in sorted(levels)},
        first.scale,
        sum(r.fit_s for r in results),
        sum(r.forecast_s for r in results),
    )
