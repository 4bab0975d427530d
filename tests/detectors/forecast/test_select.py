import numpy as np

from detectors.forecast.backtest import BacktestResult
from detectors.forecast.ensemble import Ensemble
from detectors.forecast.naive import LastValue
from detectors.forecast.select import build, select

from .synthetic import seasonal


def fake(name: str, error: float, offset: float = 0.0) -> BacktestResult:
    """A backtest whose absolute error is `error` everywhere (sign alternating by origin)."""
    actual = np.full((4, 2), 10.0)
    sign = np.array([1, -1, 1, -1])[:, None] if offset == 0 else np.array([-1, 1, -1, 1])[:, None]
    return BacktestResult(name, 60.0, np.arange(4), actual, actual + sign * error, {}, 1.0)


def test_lstm_is_not_selected_until_it_beats_the_best_baseline() -> None:
    selection, _ = select([fake("last_value", 1.0), fake("lstm", 1.2), fake("holt_winters", 1.1)], 2)
    assert selection.name == "last_value" and selection.learned_allowed == ()


def test_lstm_is_selected_when_it_wins() -> None:
    selection, _ = select([fake("last_value", 1.0), fake("lstm", 0.5)], 2)
    assert selection.name == "lstm" and selection.improvement == 0.5


def test_an_ensemble_wins_when_member_errors_cancel() -> None:
    selection, _ = select([fake("last_value", 1.0), fake("holt_winters", 1.0, offset=1)], 2)
    assert selection.name == "ensemble(last_value+holt_winters)" and selection.mase == 0.0


def test_build_returns_an_ensemble_that_forecasts_the_member_mean() -> None:
    selection, _ = select([fake("last_value", 1.0), fake("holt_winters", 1.0, offset=1)], 2)
    factories = {"last_value": LastValue, "holt_winters": lambda: LastValue(log=True)}
    ensemble = build(selection, factories)
    assert isinstance(ensemble, Ensemble)
    series = seasonal(days=1)
    members = [LastValue().fit(series).forecast(3).mean, LastValue(log=True).fit(series).forecast(3).mean]
    assert np.allclose(ensemble.fit(series).forecast(3).mean, np.mean(members, axis=0))


def test_an_ensemble_fed_live_minutes_forecasts_from_them_as_its_members_do() -> None:
    """The agent feeds the model each closed minute (``update``); a selected ensemble must pass them to
    every member, or its forecast stays at the refit while the traffic moves on."""
    series = seasonal(days=1)
    step = series.step_s
    end = series.start_s + step * len(series.values)
    live = [(end + i * step, 500.0 + 10.0 * i) for i in range(5)]
    ensemble = Ensemble([LastValue(), LastValue(log=True)]).fit(series)
    before = ensemble.forecast(3).mean
    ensemble.update(live)
    members = []
    for member in (LastValue(), LastValue(log=True)):
        member.fit(series).update(live)
        members.append(member.forecast(3).mean)
    assert np.allclose(ensemble.forecast(3).mean, np.mean(members, axis=0))
    assert not np.allclose(ensemble.forecast(3).mean, before)
