"""Level x daily shape: a smoothed recent level carried along the daily profile learned from past days.

Request counts at a one-minute step are noisy (bursts, batch clients), so the last raw value is a poor
anchor for a 30-step path, while the *shape* of the day repeats well from one weekday to the next. In log1p
space ``x = log1p(y)``, with ``P_c(tod)`` the profile of day type ``c`` (weekday or weekend) at time of day
``tod``::

    S       = centred moving average of x over ``smooth_s`` (edges use the points that exist)
    P_c     = mean of S over the last ``profile_days`` past days of type c (all days if none of type c)
    r_i     = x_i - P_{c(i)}(tod_i)                     deseasonalised recent values
    L_t     = sum_i w_i r_i / sum_i w_i,  w_i = 2^(-(t-1-i)/halflife),  i in [t - window, t)
    xhat_{t+h} = L_t + P_{c(t+h)}(tod_{t+h})            yhat = expm1(xhat) (the median if log errors
                                                         are symmetric: right for MAE)

Intervals are empirical and per horizon: at every fit the model replays itself causally over the last
``calibration_days`` of the training data (profiles from the days before each calibration origin only)
and keeps the log errors ``x_{t+h} - xhat_{t+h}``; ``q``-quantile = ``xhat + quantile_q(errors[:, h])``.
The profile is rebuilt when a new day completes, so ``extend`` keeps the model current between refits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from detectors.forecast.base import DEFAULT_QUANTILES, BaseForecaster
from detectors.forecast.naive import DAY_S
from detectors.forecast.series import FloatArray

IntArray = NDArray[np.int64]


def centred_mean(values: FloatArray, width: int) -> FloatArray:
    """Centred moving average of odd ``width``; near the edges, the mean of the points that exist."""
    kernel = np.ones(max(1, width | 1))
    total = np.convolve(values, kernel, mode="same")
    count = np.convolve(np.ones(len(values)), kernel, mode="same")
    return np.asarray(total / count, dtype=np.float64)


class LevelShape(BaseForecaster):
    """Smoothed recent level times the daily profile of the same day type (see the module docstring)."""

    name = "level_shape"

    def __init__(
        self,
        *,
        smooth_s: float = 3660.0,
        level_window_s: float = 3600.0,
        level_halflife_s: float = 900.0,
        profile_days: int = 5,
        day_types: bool = True,
        weekend: Sequence[int] = (5, 6),
        utc_offset_s: float = 0.0,
        horizon: int = 120,
        calibration_days: float = 1.0,
        calibration_stride: int = 5,
        quantiles: Sequence[float] = DEFAULT_QUANTILES,
        max_gap_steps: int = 5,
    ) -> None:
        super().__init__(quantiles, max_gap_steps)
        self.smooth_s, self.level_window_s, self.level_halflife_s = smooth_s, level_window_s, level_halflife_s
        self.profile_days, self.day_types, self.weekend = profile_days, day_types, tuple(weekend)
        self.utc_offset_s, self.horizon = utc_offset_s, horizon
        self.calibration_days, self.calibration_stride = calibration_days, calibration_stride

    # -- geometry -------------------------------------------------------------------------------------------
    def _day_steps(self) -> int:
        return max(2, round(DAY_S / self.step_s_))

    def _window(self) -> int:
        return max(1, round(self.level_window_s / self.step_s_))

    def _keep(self) -> int:
        """Steps of history kept: enough for ``profile_days`` weekend days (two per week) plus two."""
        weeks = -(-self.profile_days // 2) if self.day_types else -(-self.profile_days // 7)
        return (7 * weeks + 2) * self._day_steps()

    def _day_index(self, index: FloatArray | IntArray) -> IntArray:
        """Local day number of absolute step ``index`` (steps since ``start_s_``)."""
        seconds = self.start_s_ + self.step_s_ * np.asarray(index, dtype=np.float64) + self.utc_offset_s
        return np.floor(seconds / DAY_S).astype(np.int64)

    def _tod(self, index: IntArray) -> IntArray:
        seconds = self.start_s_ + self.step_s_ * np.asarray(index, dtype=np.float64) + self.utc_offset_s
        return (np.floor((seconds % DAY_S) / self.step_s_ + 1e-9).astype(np.int64)) % self._day_steps()

    def _is_weekend(self, day: IntArray) -> NDArray[np.bool_]:
        weekday = (day + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
        return np.isin(weekday, self.weekend) & self.day_types

    # -- learning -------------------------------------------------------------------------------------------
    def _fit(self, values: FloatArray) -> None:
        if len(values) < self._day_steps() + self._window():
            raise ValueError(
                f"{self.name} needs a full day plus the level window "
                f"({self._day_steps() + self._window()} points), got {len(values)}"
            )
        self.history_ = np.log1p(np.maximum(values, 0.0))[-self._keep() :].copy()
        self.profiles_, self.profile_day_ = self._profiles(self.history_, len(values))
        self.errors_ = self._calibrate(np.log1p(np.maximum(values, 0.0)), len(values))

    def _profiles(self, history: FloatArray, n_seen: int) -> tuple[dict[bool, FloatArray], int]:
        """Profiles by day type from the full days in ``history`` (which ends at absolute step n_seen)."""
        m = self._day_steps()
        first = n_seen - len(history)
        index = np.arange(first, n_seen)
        days = self._day_index(index)
        smoothed = centred_mean(history, max(1, round(self.smooth_s / self.step_s_)))
        current = int(self._day_index(np.array([n_seen]))[0])
        shapes: dict[int, FloatArray] = {}
        for day in np.unique(days):
            if day >= current:
                continue
            mask = days == day
            if mask.sum() < m:  # a partial first day would bias the profile
                continue
            shape = np.empty(m)
            shape[self._tod(index[mask])] = smoothed[mask]
            shapes[int(day)] = shape
        if not shapes:
            raise ValueError(f"{self.name}: no complete past day to learn the daily profile from")
        ordered = sorted(shapes)
        profiles: dict[bool, FloatArray] = {}
        for kind in (False, True):
            same = [d for d in ordered if bool(self._is_weekend(np.array([d]))[0]) == kind] or ordered
            profiles[kind] = np.mean([shapes[d] for d in same[-self.profile_days :]], axis=0)
        return profiles, current

    def _point(
        self, history: FloatArray, n_seen: int, profiles: dict[bool, FloatArray], steps: int
    ) -> FloatArray:
        """Log-space path for the ``steps`` after absolute step ``n_seen`` (history ends there)."""
        k = min(self._window(), len(history))
        index = np.arange(n_seen - k, n_seen + steps)
        weekend = self._is_weekend(self._day_index(index))
        tod = self._tod(index)
        shape = np.where(weekend, profiles[True][tod], profiles[False][tod])
        halflife = max(1e-9, self.level_halflife_s / self.step_s_)
        weights = 0.5 ** (np.arange(k)[::-1] / halflife)
        level = float(np.average(history[-k:] - shape[:k], weights=weights))
        return np.asarray(level + shape[k:], dtype=np.float64)

    def _calibrate(self, log_values: FloatArray, n_seen: int) -> FloatArray:
        """Causal replay over the last ``calibration_days``: (origins, horizon) log errors."""
        m, horizon = self._day_steps(), self.horizon
        first = max(m + self._window(), n_seen - round(self.calibration_days * m) - horizon)
        origins = range(first, n_seen - horizon + 1, max(1, self.calibration_stride))
        errors, cached_day, profiles = [], None, self.profiles_
        offset = n_seen - len(log_values)
        for origin in origins:
            past = log_values[: origin - offset][-self._keep() :]
            day = int(self._day_index(np.array([origin]))[0])
            if day != cached_day:
                try:
                    profiles, _ = self._profiles(past, origin)
                except ValueError:
                    continue
                cached_day = day
            path = self._point(past, origin, profiles, horizon)
            errors.append(log_values[origin - offset : origin - offset + horizon] - path)
        return np.array(errors, dtype=np.float64).reshape(-1, horizon)

    # -- streaming ------------------------------------------------------------------------------------------
    def _extend(self, values: FloatArray) -> None:
        joined = np.concatenate((self.history_, np.log1p(np.maximum(values, 0.0))))
        self.history_ = joined[-self._keep() :]

    def _predict(self, steps: int) -> tuple[FloatArray, dict[float, FloatArray]]:
        n_seen = self.n_seen_
        if int(self._day_index(np.array([n_seen]))[0]) != self.profile_day_:
            self.profiles_, self.profile_day_ = self._profiles(self.history_, n_seen)
        point = self._point(self.history_, n_seen, self.profiles_, steps)
        quantiles: dict[float, FloatArray] = {}
        for q in self.quantiles:
            if self.errors_.shape[0]:
                h = np.minimum(np.arange(steps), self.errors_.shape[1] - 1)
                shift = np.quantile(self.errors_, q, axis=0)[h]
            else:
                shift = np.zeros(steps)
            quantiles[q] = np.expm1(np.clip(point + shift, -50.0, 50.0))
        return np.expm1(np.clip(point, -50.0, 50.0)), quantiles
