"""One forecast target's 1-minute history and model, and the atomic save/restore of all targets.

Ticks arrive every second or so; a :class:`Track` averages the rates seen within each wall-clock minute
into one point. A minute with no sample is *missing* (NaN inside the track only, never emitted): the
models interpolate at most five missing minutes and refuse longer outages (:class:`GapError`), and a refit
uses only the history after the last long outage. State is written to a temp file, fsynced and renamed
over the old one, so a crash leaves either the old state or the new one, never half a file.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from detectors import atomic_file
from detectors.forecast.base import Forecast, Forecaster
from detectors.forecast.series import Series, fill_gaps

log = logging.getLogger(__name__)

STEP_S = 60.0
MAX_GAP_STEPS = 5
VERSION = 1


def members_of(label: str) -> list[str]:
    """``ensemble(a+b)`` -> ``[a, b]``; a single model's name -> ``[name]``."""
    if label.startswith("ensemble(") and label.endswith(")"):
        return label.removeprefix("ensemble(").removesuffix(")").split("+")
    return [label]


class Track:
    """Minute aggregation, bounded history (``keep`` minutes) and the model of one target."""

    def __init__(self, name: str, keep: int) -> None:
        self.name, self.keep = name, keep
        self.start_min: int | None = None
        self.values: list[float] = []
        self.current_min: int | None = None
        self._sum, self._count = 0.0, 0
        self.last_closed: float | None = None
        self.model: Forecaster | None = None
        self.model_name, self.members = "", list[str]()
        self.backtest: dict[str, float] = {}
        self.model_end_min = 0
        self.forecast: Forecast | None = None

    @property
    def end_min(self) -> int:
        """Minute after the last closed one."""
        return (self.start_min or 0) + len(self.values)

    def add(self, minute: int, value: float | None) -> bool:
        """Add one tick's value; True when this tick closed the previous minute (see ``last_closed``)."""
        closed = False
        if self.current_min is None:
            self.current_min = minute
        elif minute > self.current_min:
            self._close(minute)
            closed = True
        if minute == self.current_min and value is not None and math.isfinite(value) and value >= 0:
            self._sum += value
            self._count += 1
        return closed

    def _close(self, minute: int) -> None:
        assert self.current_min is not None
        mean = self._sum / self._count if self._count else math.nan
        self.last_closed = None if math.isnan(mean) else mean
        if self.start_min is None:
            if self._count:
                self.start_min, self.values = self.current_min, [mean]
        else:
            self.values.extend([math.nan] * (self.current_min - self.end_min))
            self.values.append(mean)
        if len(self.values) > self.keep:
            drop = len(self.values) - self.keep
            self.values, self.start_min = self.values[drop:], (self.start_min or 0) + drop
        self.current_min, self._sum, self._count = minute, 0.0, 0

    def usable_length(self) -> int:
        series, _ = self.series()
        return 0 if series is None else len(series)

    def series(self) -> tuple[Series | None, int]:
        """History after the last outage longer than five minutes, short gaps interpolated; and the
        minute after its last observed point."""
        array = np.asarray(self.values, dtype=np.float64)
        observed = np.flatnonzero(~np.isnan(array))
        if observed.size < 2 or self.start_min is None:
            return None, self.end_min
        jumps = np.flatnonzero(np.diff(observed) > MAX_GAP_STEPS + 1)
        first = int(observed[jumps[-1] + 1]) if jumps.size else int(observed[0])
        last = int(observed[-1]) + 1
        part = array[first:last]
        missing = np.isnan(part)
        raw = Series((self.start_min + first) * STEP_S, STEP_S, np.nan_to_num(part), missing)
        return fill_gaps(raw, "interpolate", max_gap_steps=MAX_GAP_STEPS), self.start_min + last

    def install(self, model: Forecaster, label: str, backtest: dict[str, float], end_min: int) -> None:
        self.model, self.model_name, self.members = model, label, members_of(label)
        self.backtest, self.model_end_min = dict(backtest), end_min

    def catch_up(self) -> None:
        """Feed the model the minutes closed since it last saw data (short gaps are interpolated by
        ``update``; a long one raises :class:`GapError`)."""
        if self.model is None or self.start_min is None:
            return
        first = max(self.model_end_min, self.start_min)
        points = [
            ((minute) * STEP_S, value)
            for minute, value in zip(
                range(first, self.end_min), self.values[first - self.start_min :], strict=True
            )
            if not math.isnan(value)
        ]
        if points:
            self.model.update(points)
            self.model_end_min = round(points[-1][0] / STEP_S) + 1

    def to_json(self) -> dict[str, Any]:
        return {
            "start_min": self.start_min,
            "values": [None if math.isnan(v) else v for v in self.values],
            "model_name": self.model_name,
            "backtest": self.backtest,
        }

    def load_json(self, data: Mapping[str, Any]) -> None:
        start, values = data.get("start_min"), data.get("values", [])
        self.start_min = int(start) if start is not None else None
        self.values = [math.nan if v is None else float(v) for v in values][-self.keep :]
        if self.start_min is not None:
            self.start_min += max(0, len(values) - self.keep)
        self.model_name = str(data.get("model_name", ""))
        self.members = members_of(self.model_name) if self.model_name else []
        self.backtest = {str(k): float(v) for k, v in dict(data.get("backtest", {})).items()}


class SavedState(NamedTuple):
    """What :func:`load_state` gives back besides the tracks it fills."""

    capacity_rps: float
    last_refit_s: float | None
    setup: dict[str, str]
    """What the capacity was learned on (detectors/serving_setup.py); empty when the file does not say."""


def state_document(
    tracks: Mapping[str, Track],
    capacity_rps: float,
    last_refit_s: float | None,
    setup: Mapping[str, str] | None = None,
) -> str:
    """The JSON text of the whole state (built under the caller's lock, written outside it)."""
    document = {
        "version": VERSION,
        "saturated_capacity_rps": capacity_rps,
        "capacity_setup": dict(setup or {}),
        "last_refit_s": last_refit_s,
        "tracks": {name: track.to_json() for name, track in tracks.items()},
    }
    return json.dumps(document, separators=(",", ":"))


def write_atomically(path: str, text: str) -> None:
    """The state document, written atomically (detectors/atomic_file.py)."""
    atomic_file.write_atomically(path, text.encode("utf-8"), prefix=".forecast-")


def load_state(path: str, tracks: Mapping[str, Track]) -> SavedState | None:
    """Fill ``tracks`` from ``path``; returns the rest of the state, or None when there is no usable
    file (a missing or unreadable file is logged, never raised: the agent starts fresh)."""
    try:
        with open(path, encoding="utf-8") as stream:
            document = json.load(stream)
        if document.get("version") != VERSION:
            raise ValueError(f"version {document.get('version')!r}, expected {VERSION}")
        for name, track in tracks.items():
            if name in document["tracks"]:
                track.load_json(document["tracks"][name])
        last = document.get("last_refit_s")
        # saturated_capacity_rps: learned in saturated minutes only; the "capacity_rps" saved before
        # 2026-12-06 counted every minute, a lower bound that is dropped and learned again
        capacity = float(document.get("saturated_capacity_rps", 0.0))
        setup = {str(k): str(v) for k, v in dict(document.get("capacity_setup") or {}).items()}
        return SavedState(capacity, None if last is None else float(last), setup)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("forecast state %s not restored: %s", path, error)
        return None
