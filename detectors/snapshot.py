"""Value types that flow from the collectors into the brain.

A tick produces one immutable :class:`Snapshot`: a flat mapping of canonical signal names to finite floats,
plus the status of each source (a :class:`Reading`). Flat names keep the store, the detectors and
``/api/state`` simple; the naming scheme is::

    engine.<metric>                 e.g. engine.requests_running, engine.ttft_seconds.p99
    nvml.gpu<i>.<metric>.<agg>      e.g. nvml.gpu0.utilization_ratio.mean  (agg: mean | max | last)
    nvml.gpu<i>.<metric>            per-tick values that are not aggregated (e.g. process memory)
    probe.<metric>                  e.g. probe.reserved_bytes, probe.fragmentation_ratio

Missing data is absence of the key, never NaN: a detector asks ``snapshot.get(name)`` and gets ``None``.
Ratios are 0-1, times in seconds, sizes in bytes, power in watts, energy in joules (base units).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType


class SourceStatus(StrEnum):
    """Outcome of one collection. "no data" is its own state, distinct from an error."""

    OK = "ok"
    NO_DATA = "no_data"
    ERROR = "error"


def _frozen(values: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType({k: float(v) for k, v in values.items() if math.isfinite(v)})


@dataclass(frozen=True)
class Reading:
    """What one collector saw at ``observed_at`` (seconds on the agent's clock).

    ``values`` holds finite floats only: non-finite inputs are dropped at construction so no NaN ever
    reaches a detector. ``info`` carries strings (engine kind, model name, driver version).
    """

    source: str
    observed_at: float
    status: SourceStatus
    values: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
    duration_s: float = 0.0
    info: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", _frozen(self.values))
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    @classmethod
    def failed(cls, source: str, observed_at: float, error: str, duration_s: float = 0.0) -> Reading:
        return cls(source, observed_at, SourceStatus.ERROR, error=error, duration_s=duration_s)

    @classmethod
    def empty(cls, source: str, observed_at: float, why: str, duration_s: float = 0.0) -> Reading:
        return cls(source, observed_at, SourceStatus.NO_DATA, error=why, duration_s=duration_s)


@dataclass(frozen=True)
class Snapshot:
    """Everything the brain knows at one tick. Immutable; built once per tick by the loop."""

    now: float
    values: Mapping[str, float]
    readings: Mapping[str, Reading]

    @classmethod
    def from_readings(cls, now: float, readings: Mapping[str, Reading]) -> Snapshot:
        # A Reading's values are finite floats already (checked when it was built): merge, no re-check.
        merged: dict[str, float] = {}
        for reading in readings.values():
            merged.update(reading.values)
        return cls(now, MappingProxyType(merged), MappingProxyType(dict(readings)))

    def get(self, name: str) -> float | None:
        """The value of ``name`` at this tick, or ``None`` when no source supplied it."""
        return self.values.get(name)

    def source_ok(self, source: str) -> bool:
        reading = self.readings.get(source)
        return reading is not None and reading.status is SourceStatus.OK
