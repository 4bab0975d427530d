import numpy as np
import pytest

from detectors.forecast.backtest import rolling_origin
from detectors.forecast.naive import LastValue, SeasonalNaive
from detectors.forecast.series import Series

from .synthetic import PER_DAY, seasonal


def test_seasonal_naive_repeats_the_previous_day() -> None:
    series = seasonal(days=2)
    forecast = SeasonalNaive().fit(series).forecast(PER_DAY + 2)
    expected = np.concatenate((series.values[-PER_DAY:], series.values[-PER_DAY:][:2]))
    assert np.allclose(forecast.mean, expected)


def test_seasonal_naive_80_percent_interval_covers_75_to_85_percent() -> None:
    result = rolling_origin(lambda: SeasonalNaive(), seasonal(days=12), horizon=4, initial=3 * PER_DAY)
    assert 0.75 <= result.coverage(4) <= 0.85


def test_last_value_80_percent_interval_covers_75_to_85_percent_on_a_random_walk() -> None:
    walk = Series.regular(0.0, 60.0, 1000 + np.cumsum(np.random.default_rng(1).normal(0, 1, 4000)))
    result = rolling_origin(lambda: LastValue(), walk, horizon=5, initial=1500)
    assert 0.75 <= result.coverage(5) <= 0.85


def test_seasonal_naive_needs_a_full_season() -> None:
    with pytest.raises(ValueError, match="one full season"):
        SeasonalNaive().fit(seasonal(days=1).head(PER_DAY - 1))


def test_log_space_keeps_forecasts_non_negative() -> None:
    counts = Series.regular(0.0, 60.0, np.random.default_rng(2).poisson(2.0, 500).astype(float))
    forecast = LastValue(log=True).fit(counts).forecast(10)
    assert min(values.min() for values in forecast.quantiles.values()) >= 0
