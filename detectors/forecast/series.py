"""Regular time series on a fixed step, with gaps kept explicit.

Forecasters work on a regular grid: point ``i`` of a :class:`Series` is the value for the step that starts at
``start_s + i * step_s``. Real inputs are not regular (requests arrive one by one, scrapes are missed), so
:func:`resample` puts irregular points on a grid and marks every empty step as *missing*; nothing is filled
silently. :func:`fill_gaps` then fills them with a method the caller names, because the right answer depends
on what the numbers mean: an empty bin of an event count is a real zero, a missed gauge sample is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]
Aggregate = Literal["sum", "mean", "last"]
FillMethod = Literal["error", "zero", "interpolate"]


class GapError(ValueError):
    """A series has missing steps that the chosen fill method does not allow."""


@dataclass(frozen=True, eq=False)
class Series:
    """Values on a regular grid: ``values[i]`` belongs to ``start_s + i * step_s``.

    ``missing[i]`` is True where no observation fell into step ``i``; the value there is 0 and means
    nothing until :func:`fill_gaps` decides what it should be. Values are always finite.
    """

    start_s: float
    step_s: float
    values: FloatArray
    missing: NDArray[np.bool_]

    def __post_init__(self) -> None:
        values = np.asarray(self.values, dtype=np.float64)
        missing = np.asarray(self.missing, dtype=np.bool_)
        if not self.step_s > 0 or not np.isfinite(self.step_s):
            raise ValueError(f"step_s must be a positive number, got {self.step_s}")
        if values.ndim != 1 or values.shape != missing.shape:
            raise ValueError("values and missing must be 1-D arrays of the same length")
        if not np.all(np.isfinite(values)):
            raise ValueError("series values must be finite (mark gaps as missing instead of NaN)")
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "missing", missing)

    @classmethod
    def regular(cls, start_s: float, step_s: float, values: ArrayLike) -> Series:
        """A gap-free series (every value observed)."""
        array = np.asarray(values, dtype=np.float64)
        return cls(float(start_s), float(step_s), array, np.zeros(array.shape, dtype=np.bool_))

    def __len__(self) -> int:
        return int(self.values.shape[0])

    @property
    def times(self) -> FloatArray:
        """Start time of every step, in seconds."""
        return self.start_s + self.step_s * np.arange(len(self), dtype=np.float64)

    @property
    def end_s(self) -> float:
        """Time of the step after the last one (where a forecast starts)."""
        return self.start_s + self.step_s * len(self)

    @property
    def gap_count(self) -> int:
        return int(self.missing.sum())

    def head(self, n: int) -> Series:
        """The first ``n`` steps (used by backtests to hide the future)."""
        return Series(self.start_s, self.step_s, self.values[:n].copy(), self.missing[:n].copy())

    def require_complete(self) -> FloatArray:
        """The values, or :class:`GapError` if any step is missing."""
        if self.gap_count:
            first = self.start_s + int(np.argmax(self.missing)) * self.step_s
            raise GapError(
                f"series has {self.gap_count} missing steps (first at t={first:g}); "
                "fill them with fill_gaps(...) first"
            )
        return self.values


def resample(
    times_s: ArrayLike,
    values: ArrayLike | None,
    step_s: float,
    *,
    how: Aggregate = "sum",
    start_s: float | None = None,
    end_s: float | None = None,
) -> Series:
    """Aggregate irregular points ``(times_s[i], values[i])`` onto a grid of ``step_s``.

    ``values=None`` counts points (arrivals per step). ``start_s`` defaults to the first time floored to
    the step; ``end_s`` (exclusive) to just past the last time. Steps with no point are marked missing;
    with ``how="sum"`` and counting you usually want ``fill_gaps(series, "zero")`` next, since no arrival
    in a step is a real zero. Non-finite times or values raise ``ValueError``.
    """
    t = np.asarray(times_s, dtype=np.float64)
    v = np.ones_like(t) if values is None else np.asarray(values, dtype=np.float64)
    if t.ndim != 1 or t.shape != v.shape:
        raise ValueError("times and values must be 1-D arrays of the same length")
    if t.size == 0:
        raise ValueError("cannot resample an empty series")
    if not (np.all(np.isfinite(t)) and np.all(np.isfinite(v))):
        raise ValueError("times and values must be finite")
    if not step_s > 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    start = float(np.floor(t.min() / step_s) * step_s) if start_s is None else float(start_s)
    if end_s is None:
        n = int(np.floor((float(t.max()) - start) / step_s + 1e-9)) + 1
    else:
        n = max(0, int(np.ceil((float(end_s) - start) / step_s - 1e-9)))
    index = np.floor((t - start) / step_s + 1e-9).astype(np.int64)
    keep = (index >= 0) & (index < n)
    index, v, t_kept = index[keep], v[keep], t[keep]
    counts = np.bincount(index, minlength=n)
    if how == "sum":
        out = np.bincount(index, weights=v, minlength=n).astype(np.float64)
    elif how == "mean":
        sums = np.bincount(index, weights=v, minlength=n)
        out = np.divide(sums, counts, out=np.zeros(n), where=counts > 0)
    elif how == "last":
        order = np.lexsort((t_kept, index))
        out = np.zeros(n)
        out[index[order]] = v[order]  # later writes win, so each step keeps its latest point
    else:
        raise ValueError(f"unknown aggregate {how!r}")
    return Series(start, float(step_s), out, counts == 0)


def fill_gaps(series: Series, method: FillMethod = "error", *, max_gap_steps: int | None = None) -> Series:
    """Return a copy of ``series`` without missing steps, filled by ``method``.

    * ``"error"``: raise :class:`GapError` if anything is missing (the default: never guess).
    * ``"zero"``: missing steps are 0 (right for event counts, where an empty bin means no events).
    * ``"interpolate"``: linear between the neighbouring observed values; leading/trailing gaps take the
      nearest observed value.

    ``max_gap_steps`` bounds the longest run of missing steps any method may fill; a longer run raises
    :class:`GapError`, because inventing an hour of traffic would teach a forecaster fiction.
    """
    missing = series.missing
    if not missing.any():
        return series
    if method == "error":
        series.require_complete()
    longest = _longest_run(missing)
    if max_gap_steps is not None and longest > max_gap_steps:
        raise GapError(f"a gap of {longest} steps exceeds max_gap_steps={max_gap_steps}")
    values = series.values.copy()
    if method == "zero":
        values[missing] = 0.0
    elif method == "interpolate":
        observed = np.flatnonzero(~missing)
        if observed.size == 0:
            raise GapError("cannot interpolate a series with no observed steps")
        values[missing] = np.interp(np.flatnonzero(missing), observed, values[observed])
    else:
        raise ValueError(f"unknown fill method {method!r}")
    return Series(series.start_s, series.step_s, values, np.zeros_like(missing))


def _longest_run(mask: NDArray[np.bool_]) -> int:
    padded = np.concatenate(([0], mask.astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(padded))
    return int((edges[1::2] - edges[::2]).max()) if edges.size else 0
