import numpy as np
import pytest

from detectors.forecast.series import GapError, Series, fill_gaps, resample


def test_resample_counts_points_per_step_and_marks_empty_steps_missing() -> None:
    series = resample([0.0, 10.0, 65.0, 190.0], None, 60.0)
    assert series.values.tolist() == [2.0, 1.0, 0.0, 1.0]
    assert series.missing.tolist() == [False, False, True, False]


def test_resample_mean_averages_values_within_a_step() -> None:
    series = resample([0.0, 30.0, 60.0], [1.0, 3.0, 7.0], 60.0, how="mean")
    assert series.values.tolist() == [2.0, 7.0]


def test_gaps_are_never_zero_filled_by_default() -> None:
    series = resample([0.0, 180.0], [5.0, 5.0], 60.0)
    with pytest.raises(GapError, match="2 missing steps"):
        fill_gaps(series)


def test_zero_fill_is_explicit_for_counts() -> None:
    filled = fill_gaps(resample([0.0, 180.0], None, 60.0), "zero")
    assert filled.values.tolist() == [1.0, 0.0, 0.0, 1.0] and filled.gap_count == 0


def test_interpolation_fills_linearly_between_observations() -> None:
    filled = fill_gaps(resample([0.0, 180.0], [10.0, 40.0], 60.0, how="mean"), "interpolate")
    assert filled.values.tolist() == [10.0, 20.0, 30.0, 40.0]


def test_a_gap_longer_than_the_limit_is_refused() -> None:
    with pytest.raises(GapError, match="exceeds max_gap_steps=1"):
        fill_gaps(resample([0.0, 180.0], [1.0, 1.0], 60.0), "interpolate", max_gap_steps=1)


def test_series_rejects_nan_values() -> None:
    with pytest.raises(ValueError, match="finite"):
        Series.regular(0.0, 60.0, [1.0, np.nan])


def test_require_complete_names_the_first_gap() -> None:
    series = resample([0.0, 120.0], [1.0, 1.0], 60.0)
    with pytest.raises(GapError, match="t=60"):
        series.require_complete()
