"""Choose the forecaster (or equal-weight ensemble) that wins the recent backtest.

Rules, in order:

1. Only models whose backtest ran are candidates (a weekly seasonal naive needs a week of history).
2. A learned model (the LSTM) drives nothing until its MASE beats the best baseline's; until then it is
   neither selected nor part of an ensemble. Baselines: last value, seasonal naive, Holt-Winters.
3. Among the candidates and every equal-weight ensemble of 2..``max_members`` of the best ``pool``
   candidates (scored from the stored backtest paths), the lowest MASE at the target horizon wins; ties
   go to the simpler choice (a single model, then fewer members).

Selecting on the same backtest that reports the score flatters the winner slightly (a handful of
candidates); the agent re-runs the backtest on fresh data before trusting a switch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from detectors.forecast.backtest import BacktestResult, combine
from detectors.forecast.base import Forecaster
from detectors.forecast.ensemble import Ensemble
from detectors.forecast.ets import Arima, HoltWinters
from detectors.forecast.lstm import LSTMForecaster
from detectors.forecast.naive import DAY_S, WEEK_S, LastValue, SeasonalNaive
from detectors.forecast.profile import LevelShape

BASELINES: tuple[str, ...] = ("last_value", "seasonal_naive_1d", "seasonal_naive_1w", "holt_winters")
LEARNED: tuple[str, ...] = ("lstm",)


def default_factories(
    *, log: bool = True, horizon_steps: int = 60, arima: bool = True, lstm: bool = True
) -> dict[str, Callable[[], Forecaster]]:
    """The registry of forecasters by name (explicit, no import-time side effects). ``log`` fits the
    statistical models in log1p space, right for request counts whose daily cycle is multiplicative."""
    factories: dict[str, Callable[[], Forecaster]] = {
        "last_value": lambda: LastValue(log=log),
        "seasonal_naive_1d": lambda: SeasonalNaive(DAY_S, log=log),
        "seasonal_naive_1w": lambda: SeasonalNaive(WEEK_S, log=log),
        "holt_winters": lambda: HoltWinters(DAY_S, log=log),
    }
    factories["level_shape"] = lambda: LevelShape(horizon=max(horizon_steps, 1))
    if arima:
        factories["arima"] = lambda: Arima(log=log)
    if lstm:
        factories["lstm"] = lambda: LSTMForecaster(horizon=max(horizon_steps, 1))
    return factories


@dataclass(frozen=True)
class Selection:
    """What the selector picked at ``steps`` and why."""

    name: str
    members: tuple[str, ...]
    mase: float
    best_baseline: str
    best_baseline_mase: float
    learned_allowed: tuple[str, ...]

    @property
    def improvement(self) -> float:
        """Relative MASE reduction against the best baseline (0.2 = 20% lower)."""
        return 1.0 - self.mase / self.best_baseline_mase if self.best_baseline_mase > 0 else 0.0


def select(
    results: Sequence[BacktestResult], steps: int, *, max_members: int = 3, pool: int = 4
) -> tuple[Selection, list[BacktestResult]]:
    """Apply the module's rules; returns the selection and the ensembles that were scored."""
    ok = [r for r in results if r.ok]
    baselines = [r for r in ok if r.name in BASELINES]
    if not baselines:
        raise ValueError("no baseline could be backtested; the series is too short")
    best_baseline = min(baselines, key=lambda r: r.mase(steps))
    bar = best_baseline.mase(steps)
    allowed = tuple(r.name for r in ok if r.name in LEARNED and r.mase(steps) < bar)
    candidates = sorted(
        (r for r in ok if r.name not in LEARNED or r.name in allowed), key=lambda r: r.mase(steps)
    )
    ensembles = [
        combine(group)
        for size in range(2, max_members + 1)
        for group in itertools.combinations(candidates[:pool], size)
    ]
    scored = [(r.mase(steps), 0, 1, r) for r in candidates]
    scored += [(r.mase(steps), 1, r.name.count("+") + 1, r) for r in ensembles]
    mase, _, _, winner = min(scored, key=lambda item: item[:3])
    members = tuple(winner.name.removeprefix("ensemble(").removesuffix(")").split("+"))
    selection = Selection(winner.name, members, mase, best_baseline.name, bar, allowed)
    return selection, ensembles


def build(selection: Selection, factories: Mapping[str, Callable[[], Forecaster]]) -> Forecaster:
    """A fresh (unfitted) forecaster for what was selected: one model, or an :class:`Ensemble`."""
    if len(selection.members) == 1:
        return factories[selection.members[0]]()
    return Ensemble([factories[name]() for name in selection.members], name=selection.name)
