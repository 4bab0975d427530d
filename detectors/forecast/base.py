"""The Forecaster Protocol, the Forecast value type and the grid bookkeeping every forecaster shares.

A forecaster learns from a regular series (:class:`~detectors.forecast.series.Series`), is kept current with
new ``(t, value)`` points, and answers with a :class:`Forecast`: the times it covers, a point forecast and
quantiles (``q=0.1`` and ``q=0.9`` bound the 80% prediction interval). A forecast is never a bare float.

The live agent calls ``update`` once a minute with the request rate and publishes
``servepilot_forecast_requests_per_second{horizon,quantile}`` from ``forecast(steps)``; backtests call
``extend`` with values already on the grid.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike, NDArray

from detectors.forecast.series import FloatArray, GapError, Series

DEFAULT_QUANTILES: tuple[float, ...] = (0.1, 0.5, 0.9)


@dataclass(frozen=True, eq=False)
class Forecast:
    """``steps`` future values starting at ``start_s`` on a grid of ``step_s`` seconds.

    ``mean[k]`` is the point forecast for ``start_s + k * step_s``; ``quantiles[q][k]`` its ``q``-quantile.
    Quantiles are made non-crossing (sorted per step) and everything is finite.
    """

    start_s: float
    step_s: float
    mean: FloatArray
    quantiles: Mapping[float, FloatArray]

    def __post_init__(self) -> None:
        mean = np.asarray(self.mean, dtype=np.float64)
        levels = sorted(float(q) for q in self.quantiles)
        if any(not 0.0 < q < 1.0 for q in levels):
            raise ValueError(f"quantile levels must be in (0, 1), got {levels}")
        stacked = (
            np.array([np.asarray(self.quantiles[q], dtype=np.float64) for q in levels]).reshape(
                len(levels), mean.shape[0]
            )
            if levels
            else np.zeros((0, mean.shape[0]))
        )
        if stacked.shape[1] != mean.shape[0]:
            raise ValueError("every quantile needs one value per forecast step")
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(stacked))):
            raise ValueError("forecast contains NaN or Inf")
        stacked = np.sort(stacked, axis=0)  # quantile crossing is never meaningful
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "quantiles", MappingProxyType(dict(zip(levels, stacked, strict=True))))

    @property
    def steps(self) -> int:
        return int(self.mean.shape[0])

    @property
    def times(self) -> FloatArray:
        """Time of every forecast step, in seconds."""
        return self.start_s + self.step_s * np.arange(self.steps, dtype=np.float64)

    def interval(self, coverage: float = 0.8) -> tuple[FloatArray, FloatArray]:
        """Central prediction interval, e.g. 0.8 -> (q0.1, q0.9). Raises KeyError if not forecast."""
        low, high = round((1 - coverage) / 2, 6), round((1 + coverage) / 2, 6)
        levels = {round(q, 6): values for q, values in self.quantiles.items()}
        if low not in levels or high not in levels:
            raise KeyError(f"no {coverage:.0%} interval: quantiles are {sorted(self.quantiles)}")
        return levels[low], levels[high]

    def to_json(self) -> dict[str, object]:
        return {
            "start_s": self.start_s,
            "step_s": self.step_s,
            "mean": self.mean.tolist(),
            "quantiles": {f"{q:g}": v.tolist() for q, v in self.quantiles.items()},
        }


@runtime_checkable
class Forecaster(Protocol):
    """What the agent, the backtest and the selector need from any forecaster."""

    name: str

    def fit(self, series: Series) -> Forecaster:
        """Learn from a gap-free series; returns self."""
        ...

    def update(self, points: Iterable[tuple[float, float]]) -> None:
        """Append new ``(t, value)`` observations that continue the grid."""
        ...

    def extend(self, values: ArrayLike) -> None:
        """Append values for the next steps of the grid (no timestamps needed)."""
        ...

    def forecast(self, steps: int) -> Forecast:
        """Forecast the next ``steps`` steps after the last observation."""
        ...


class BaseForecaster(ABC):
    """Grid bookkeeping shared by the concrete forecasters (scikit-learn conventions: ``__init__`` only
    stores parameters, learned state ends in ``_``, ``fit`` returns ``self``).

    ``update`` accepts points on the grid; a point that skips up to ``max_gap_steps`` steps has the skipped
    steps filled by linear interpolation (and counted in ``gaps_filled_``), a longer jump raises
    :class:`GapError`, a point in the past or off the grid raises ``ValueError``. Nothing is zero-filled.
    """

    name: str = "forecaster"
    #: Fewest points ``fit`` accepts.
    min_history: int = 2

    def __init__(self, quantiles: Sequence[float] = DEFAULT_QUANTILES, max_gap_steps: int = 5) -> None:
        self.quantiles = tuple(quantiles)
        self.max_gap_steps = max_gap_steps

    def fit(self, series: Series) -> BaseForecaster:
        values = series.require_complete()
        if len(values) < self.min_history:
            raise ValueError(f"{self.name} needs at least {self.min_history} points, got {len(values)}")
        self.start_s_ = series.start_s
        self.step_s_ = series.step_s
        self.n_seen_ = len(values)
        self.last_value_ = float(values[-1])
        self.gaps_filled_ = 0
        self._fit(values)
        return self

    def extend(self, values: ArrayLike) -> None:
        array = np.atleast_1d(np.asarray(values, dtype=np.float64))
        if not np.all(np.isfinite(array)):
            raise ValueError(f"{self.name}: update values must be finite")
        if array.size == 0:
            return
        self._check_fitted()
        self._extend(array)
        self.n_seen_ += int(array.size)
        self.last_value_ = float(array[-1])

    def update(self, points: Iterable[tuple[float, float]]) -> None:
        self._check_fitted()
        for t, value in points:
            if not (math.isfinite(t) and math.isfinite(value)):
                raise ValueError(f"{self.name}: point ({t}, {value}) is not finite")
            offset = (t - self.end_s) / self.step_s_
            steps = round(offset)
            if abs(offset - steps) > 0.01:
                raise ValueError(f"{self.name}: t={t:g} is off the {self.step_s_:g}-s grid")
            if steps < 0:
                raise ValueError(f"{self.name}: t={t:g} is not after the last point (next is {self.end_s:g})")
            if steps > self.max_gap_steps:
                raise GapError(
                    f"{self.name}: {steps} missing steps before t={t:g} (max {self.max_gap_steps})"
                )
            filled = np.linspace(self.last_value_, value, steps + 2)[1:-1]
            self.gaps_filled_ += steps
            self.extend(np.append(filled, value))

    def forecast(self, steps: int) -> Forecast:
        self._check_fitted()
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        mean, quantiles = self._predict(steps)
        return Forecast(self.end_s, self.step_s_, mean, quantiles)

    @property
    def end_s(self) -> float:
        """Time of the next step (the first one a forecast covers)."""
        return float(self.start_s_ + self.step_s_ * self.n_seen_)

    def _check_fitted(self) -> None:
        if not hasattr(self, "n_seen_"):
            raise RuntimeError(f"{self.name} is not fitted; call fit(series) first")

    @abstractmethod
    def _fit(self, values: FloatArray) -> None: ...

    @abstractmethod
    def _extend(self, values: FloatArray) -> None: ...

    @abstractmethod
    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]: ...


def empirical_quantiles(
    point: FloatArray, residuals: FloatArray, quantiles: Sequence[float]
) -> dict[float, FloatArray]:
    """Quantiles as ``point + quantile(residuals)``; ``residuals`` is (n,) shared by all steps or
    (n, steps) with one column per step ahead. Used by models whose errors we can measure in-sample."""
    out: dict[float, FloatArray] = {}
    for q in quantiles:
        shift = np.quantile(residuals, q, axis=0) if residuals.size else np.zeros(point.shape)
        out[q] = point + shift
    return out


def gaussian_quantiles(
    point: FloatArray, sigma: FloatArray, quantiles: Sequence[float]
) -> dict[float, FloatArray]:
    """Quantiles ``point + sigma * Phi^-1(q)`` of a normal predictive distribution."""
    from statistics import NormalDist

    normal = NormalDist()
    return {q: point + sigma * normal.inv_cdf(q) for q in quantiles}


class Transform:
    """``log1p`` (``y -> log(1 + y)``) or identity. Counts vary multiplicatively over the day, so the log
    turns a seasonal *ratio* into an additive offset and makes error spread roughly level-independent.
    Quantiles survive any monotone transform, so intervals map back exactly; the back-transformed
    mean is the median of a symmetric log-space error, which is what we report as the point forecast."""

    def __init__(self, log: bool) -> None:
        self.log = log

    def forward(self, values: FloatArray) -> FloatArray:
        if not self.log:
            return values
        if np.any(values < 0):
            raise ValueError("log1p transform needs non-negative values")
        return np.log1p(values)

    def inverse(self, values: NDArray[np.float64]) -> FloatArray:
        if not self.log:
            return values
        return np.maximum(np.expm1(np.clip(values, -50.0, 50.0)), 0.0)  # counts are never negative
