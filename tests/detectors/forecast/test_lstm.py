import numpy as np
import pytest

from detectors.forecast.lstm import LSTMForecaster, calendar_features

from .synthetic import MONDAY_S, PER_DAY, seasonal


def small() -> LSTMForecaster:
    return LSTMForecaster(lookback=8, horizon=4, hidden=8, epochs=2, retrain_epochs=1, batch_size=32)


def test_forecast_has_one_value_per_step_and_ordered_quantiles() -> None:
    forecast = small().fit(seasonal(days=3)).forecast(4)
    assert forecast.mean.shape == (4,)
    assert np.all(forecast.quantiles[0.1] <= forecast.quantiles[0.9])


def test_training_is_reproducible_with_a_fixed_seed() -> None:
    series = seasonal(days=3)
    assert np.array_equal(small().fit(series).forecast(4).mean, small().fit(series).forecast(4).mean)


def test_save_and_load_give_identical_forecasts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = small().fit(seasonal(days=3))
    model.extend([101.0, 99.0])
    model.save(tmp_path / "lstm.pt")
    restored = LSTMForecaster.load(tmp_path / "lstm.pt")
    before, after = model.forecast(4), restored.forecast(4)
    assert np.array_equal(before.mean, after.mean) and before.start_s == after.start_s
    assert all(np.array_equal(before.quantiles[q], after.quantiles[q]) for q in before.quantiles)
    assert [p.name for p in tmp_path.iterdir()] == ["lstm.pt"]  # the temporary file was renamed away


def test_warm_start_refit_continues_from_the_current_weights() -> None:
    series = seasonal(days=4)
    model = small().fit(series.head(3 * PER_DAY))
    weights = [p.detach().clone() for p in model.network_.parameters()]
    model.fit(series)
    assert model.fits_ == 2
    assert any(
        not np.array_equal(a.numpy(), b.detach().numpy())
        for a, b in zip(weights, model.network_.parameters(), strict=True)
    )


def test_asking_beyond_the_trained_horizon_is_an_error() -> None:
    with pytest.raises(ValueError, match="at most 4 steps"):
        small().fit(seasonal(days=3)).forecast(5)


def test_calendar_features_know_monday_midnight() -> None:
    features = calendar_features(np.array([MONDAY_S, MONDAY_S + 5 * 86_400.0]))
    assert features[0, :2].tolist() == pytest.approx([0.0, 1.0])  # hour of day 0
    assert features[0, 2:4].tolist() == pytest.approx([0.0, 1.0])  # Monday
    assert features[:, 4].tolist() == [0.0, 1.0]  # Saturday is weekend
