import warnings

import numpy as np
from statsmodels.tsa.holtwinters import ExponentialSmoothing

from detectors.forecast.backtest import rolling_origin
from detectors.forecast.ets import Arima, HoltWinters
from detectors.forecast.naive import SeasonalNaive

from .synthetic import PER_DAY, STEP_S, seasonal


def _statsmodels(values: np.ndarray) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ExponentialSmoothing(
            values, seasonal="add", seasonal_periods=PER_DAY, initialization_method="heuristic"
        ).fit()


def test_holt_winters_forecast_matches_statsmodels_after_fit() -> None:
    series = seasonal(days=4)
    ours = HoltWinters().fit(series).forecast(PER_DAY - 1).mean
    theirs = _statsmodels(series.values).forecast(PER_DAY - 1)  # type: ignore[attr-defined]
    assert np.allclose(ours, theirs, atol=1e-8)


def test_holt_winters_extend_equals_filtering_with_the_fitted_weights() -> None:
    series = seasonal(days=5)
    model = HoltWinters().fit(series.head(4 * PER_DAY))
    model.extend(series.values[4 * PER_DAY :])
    fitted = _statsmodels(series.values[: 4 * PER_DAY])
    params = fitted.params  # type: ignore[attr-defined]
    refiltered = ExponentialSmoothing(
        series.values,
        seasonal="add",
        seasonal_periods=PER_DAY,
        initialization_method="known",
        initial_level=params["initial_level"],
        initial_seasonal=params["initial_seasons"],
    ).fit(
        smoothing_level=params["smoothing_level"],
        smoothing_seasonal=params["smoothing_seasonal"],
        optimized=False,
    )
    assert np.allclose(model.forecast(PER_DAY - 1).mean, refiltered.forecast(PER_DAY - 1), atol=1e-6)


def test_holt_winters_80_percent_interval_covers_75_to_85_percent() -> None:
    result = rolling_origin(
        lambda: HoltWinters(), seasonal(days=10, seed=3), horizon=4, initial=3 * PER_DAY, stride=1
    )
    assert 0.75 <= result.coverage(4) <= 0.85


def test_holt_winters_beats_seasonal_naive_on_stable_seasonal_data() -> None:
    series = seasonal(days=8)
    smoothed = rolling_origin(lambda: HoltWinters(), series, horizon=4, initial=3 * PER_DAY)
    naive = rolling_origin(lambda: SeasonalNaive(), series, horizon=4, initial=3 * PER_DAY)
    assert smoothed.mase(4) < naive.mase(4)  # smoothing averages some of the noise the naive copies


def test_arima_extend_moves_the_forecast_start() -> None:
    series = seasonal(days=3)
    model = Arima(fit_window_s=2 * 86_400).fit(series.head(2 * PER_DAY))
    model.extend(series.values[2 * PER_DAY :])
    forecast = model.forecast(3)
    assert forecast.start_s == series.end_s and forecast.step_s == STEP_S
    assert np.all(forecast.quantiles[0.1] < forecast.quantiles[0.9])
