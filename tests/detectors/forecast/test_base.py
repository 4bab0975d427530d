import numpy as np
import pytest

from detectors.forecast.base import Forecast
from detectors.forecast.naive import LastValue
from detectors.forecast.series import GapError, Series


def fitted() -> LastValue:
    return LastValue().fit(Series.regular(0.0, 60.0, np.arange(100.0)))


def test_forecast_sorts_crossing_quantiles() -> None:
    forecast = Forecast(0.0, 60.0, np.array([1.0]), {0.9: np.array([0.0]), 0.1: np.array([2.0])})
    assert forecast.interval(0.8) == (np.array([0.0]), np.array([2.0]))


def test_forecast_refuses_nan() -> None:
    with pytest.raises(ValueError, match="NaN"):
        Forecast(0.0, 60.0, np.array([np.nan]), {})


def test_forecast_times_start_after_the_last_point() -> None:
    assert fitted().forecast(3).times.tolist() == [6000.0, 6060.0, 6120.0]


def test_update_appends_points_on_the_grid() -> None:
    forecaster = fitted()
    forecaster.update([(6000.0, 500.0)])
    assert forecaster.forecast(1).mean[0] == 500.0 and forecaster.end_s == 6060.0


def test_update_interpolates_a_short_gap_and_counts_it() -> None:
    forecaster = fitted()
    forecaster.update([(6120.0, 105.0)])
    assert forecaster.gaps_filled_ == 2 and forecaster.end_s == 6180.0


def test_update_refuses_a_long_gap() -> None:
    with pytest.raises(GapError, match="missing steps"):
        fitted().update([(6000.0 + 60 * 10, 1.0)])


def test_update_refuses_points_in_the_past_or_off_grid() -> None:
    with pytest.raises(ValueError, match="not after"):
        fitted().update([(60.0, 1.0)])
    with pytest.raises(ValueError, match="off the"):
        fitted().update([(6010.0, 1.0)])


def test_update_refuses_non_finite_values() -> None:
    with pytest.raises(ValueError, match="not finite"):
        fitted().update([(6000.0, float("inf"))])
