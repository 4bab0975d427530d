import numpy as np
import pytest

from detectors.forecast.backtest import rolling_origin
from detectors.forecast.naive import SeasonalNaive
from detectors.forecast.profile import LevelShape, centred_mean
from detectors.forecast.series import Series
from tests.detectors.forecast.synthetic import MONDAY_S, PER_DAY, STEP_S

DAY = PER_DAY


def _weekly(days: int, noise: float = 0.05, seed: int = 0) -> Series:
    """Log-normal counts: weekdays peak at 1000 in the afternoon, weekends at a flatter 300."""
    rng = np.random.default_rng(seed)
    t = np.arange(days * DAY)
    weekday = (t // DAY) % 7  # MONDAY_S is a Monday
    shape = np.sin(2 * np.pi * (t % DAY) / DAY - np.pi / 2)
    log_level = np.where(weekday >= 5, np.log(200) + 0.4 * shape, np.log(400) + 0.9 * shape)
    return Series.regular(MONDAY_S, STEP_S, np.exp(log_level + rng.normal(0, noise, t.size)))


def test_centred_mean_averages_only_existing_points_at_the_edges() -> None:
    assert centred_mean(np.array([1.0, 2.0, 3.0, 10.0]), 3).tolist() == [1.5, 2.0, 5.0, 6.5]


def test_needs_a_full_day_of_history() -> None:
    with pytest.raises(ValueError, match="full day"):
        LevelShape().fit(Series.regular(MONDAY_S, STEP_S, np.ones(DAY)))


def test_saturday_follows_the_weekend_profile_not_friday() -> None:
    series = _weekly(14, noise=0.0)
    saturday_noon = 12 * DAY + DAY // 2  # day 12 is a Saturday
    model = LevelShape(level_window_s=2 * 3600).fit(series.head(12 * DAY + 6))
    model.extend(series.values[12 * DAY + 6 : saturday_noon])
    forecast = model.forecast(4).mean
    assert forecast == pytest.approx(series.values[saturday_noon : saturday_noon + 4], rel=0.02)


def test_a_level_shift_is_followed_within_hours() -> None:
    series = _weekly(10, noise=0.0)
    shifted = series.values.copy()
    shifted[8 * DAY :] *= 2.0
    model = LevelShape().fit(Series.regular(MONDAY_S, STEP_S, shifted[: 8 * DAY + 6]))
    assert model.forecast(1).mean[0] == pytest.approx(shifted[8 * DAY + 6], rel=0.05)


def test_80_percent_interval_covers_75_to_85_percent() -> None:
    series = _weekly(28, noise=0.2, seed=3)
    result = rolling_origin(
        lambda: LevelShape(horizon=4, calibration_days=7, calibration_stride=1),
        series,
        horizon=4,
        initial=14 * DAY,
        refit_every=DAY,
    )
    assert 0.75 <= result.coverage(4) <= 0.85


def test_beats_seasonal_naive_on_the_monday_after_a_weekend() -> None:
    series = _weekly(15, noise=0.1, seed=1).head(15 * DAY)  # day 14 is a Monday
    kwargs = {"horizon": 4, "initial": 14 * DAY, "refit_every": DAY}
    shape = rolling_origin(lambda: LevelShape(horizon=4), series, **kwargs)  # type: ignore[arg-type]
    naive = rolling_origin(lambda: SeasonalNaive(log=True), series, **kwargs)  # type: ignore[arg-type]
    assert shape.mase(4) < 0.5 * naive.mase(4)


def test_forecasts_do_not_change_when_the_future_changes() -> None:
    series = _weekly(6)
    altered = series.values.copy()
    altered[4 * DAY :] *= 3
    other = Series.regular(MONDAY_S, STEP_S, altered)
    a = rolling_origin(LevelShape, series, horizon=3, initial=2 * DAY, stride=3, refit_every=DAY)
    b = rolling_origin(LevelShape, other, horizon=3, initial=2 * DAY, stride=3, refit_every=DAY)
    before = a.origins + 3 <= 4 * DAY
    assert np.array_equal(a.mean[before], b.mean[before])
