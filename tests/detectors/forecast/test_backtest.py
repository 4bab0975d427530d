from collections.abc import Iterable

import numpy as np
from numpy.typing import ArrayLike

from detectors.forecast.backtest import combine, naive_scale, rolling_origin
from detectors.forecast.base import Forecast
from detectors.forecast.naive import LastValue
from detectors.forecast.series import Series


class Spy:
    """Records how many points it has seen each time it is asked to forecast."""

    name = "spy"

    def __init__(self, log: list[tuple[int, float]]) -> None:
        self.log, self.values = log, np.zeros(0)

    def fit(self, series: Series) -> "Spy":
        self.values, self.start_s, self.step_s = series.values.copy(), series.start_s, series.step_s
        return self

    def update(self, points: Iterable[tuple[float, float]]) -> None:
        self.extend([value for _, value in points])

    def extend(self, values: ArrayLike) -> None:
        self.values = np.concatenate((self.values, np.atleast_1d(np.asarray(values, dtype=float))))

    def forecast(self, steps: int) -> Forecast:
        self.log.append((len(self.values), float(self.values.max())))
        start = self.start_s + self.step_s * len(self.values)
        return Forecast(start, self.step_s, np.full(steps, self.values[-1]), {})


def test_backtest_never_shows_the_forecaster_the_future() -> None:
    series = Series.regular(0.0, 60.0, np.arange(200.0))
    log: list[tuple[int, float]] = []
    result = rolling_origin(lambda: Spy(log), series, horizon=10, initial=50, stride=7, refit_every=30)
    assert [seen for seen, _ in log] == result.origins.tolist()
    assert all(largest == seen - 1 for seen, largest in log)  # value i == i: the largest seen is origin-1


def test_backtest_forecasts_do_not_change_when_the_future_changes() -> None:
    values = np.random.default_rng(0).normal(100, 5, 300)
    altered = values.copy()
    altered[200:] *= 10
    a = rolling_origin(LastValue, Series.regular(0.0, 60.0, values), horizon=5, initial=100, stride=5)
    b = rolling_origin(LastValue, Series.regular(0.0, 60.0, altered), horizon=5, initial=100, stride=5)
    before = a.origins <= 200
    assert np.array_equal(a.mean[before], b.mean[before])


def test_last_value_mase_at_one_step_is_close_to_one_on_a_random_walk() -> None:
    walk = 1000 + np.cumsum(np.random.default_rng(4).normal(0, 1, 3000))
    result = rolling_origin(LastValue, Series.regular(0.0, 60.0, walk), horizon=1, initial=1500)
    assert 0.9 < result.mase(1) < 1.1


def test_smape_is_zero_for_a_perfect_forecast() -> None:
    series = Series.regular(0.0, 60.0, np.full(100, 7.0))
    assert rolling_origin(LastValue, series, horizon=3, initial=50).smape(3) == 0.0


def test_naive_scale_of_a_constant_series_is_one() -> None:
    assert naive_scale(np.full(10, 3.0)) == 1.0


def test_combine_averages_member_paths() -> None:
    series = Series.regular(0.0, 60.0, np.random.default_rng(5).normal(100, 5, 300))
    a = rolling_origin(LastValue, series, horizon=3, initial=100, stride=10)
    b = rolling_origin(lambda: LastValue(log=True), series, horizon=3, initial=100, stride=10, name="log")
    assert np.allclose(combine([a, b]).mean, (a.mean + b.mean) / 2)
    assert combine([a, b]).name == "ensemble(last_value+log)"


def test_a_model_that_cannot_fit_is_reported_not_raised() -> None:
    from detectors.forecast.naive import WEEK_S, SeasonalNaive

    series = Series.regular(0.0, 60.0, np.ones(500))
    result = rolling_origin(lambda: SeasonalNaive(WEEK_S), series, horizon=5, initial=100)
    assert not result.ok and "full season" in (result.error or "")
