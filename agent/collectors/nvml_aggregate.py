"""Per-tick aggregation of NVML samples into flat signals: pure, no I/O, no threads.

The sampler adds each :class:`~agent.collectors.nvml_backend.GpuSample` to a :class:`GpuAccumulator`
(running sums, so memory use does not grow with the sampling rate); at each tick :func:`build_values` turns
the drained accumulators into the names of :mod:`detectors.snapshot`. For a continuous metric ``x`` over
the ``n`` finite samples of a tick::

    mean = sum(x) / n      max = max(x)      last = x_n

Memory used/total and the throttle bitmask are the tick's last value; ``throttle.<reason>`` is 1 when the
reason was active in any sample of the tick, so a 100 ms power-cap event is not lost between ticks.
Energy, power limit and per-process memory are the latest slow read, carried across ticks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import inf, isfinite

from agent.collectors.nvml_backend import THROTTLE_REASONS, GpuSample

#: Continuous metrics, aggregated as mean / max / last. Order matches :meth:`GpuAccumulator.add`.
CONTINUOUS: tuple[str, ...] = (
    "utilization_ratio",
    "memory_bandwidth_utilization_ratio",
    "sm_clock_hz",
    "memory_clock_hz",
    "temperature_celsius",
    "power_watts",
)


class GpuAccumulator:
    """Running aggregates of one GPU over one tick. Plain lists of floats: for six scalars, Python float
    arithmetic is cheaper than building numpy arrays each sample."""

    __slots__ = (
        "count",
        "last",
        "memory_total",
        "memory_used",
        "peak",
        "samples",
        "throttle_any",
        "throttle_last",
        "total",
    )

    def __init__(self) -> None:
        width = len(CONTINUOUS)
        self.samples = 0
        self.count = [0] * width
        self.total = [0.0] * width
        self.peak = [-inf] * width
        self.last = [0.0] * width
        self.memory_used: float | None = None
        self.memory_total: float | None = None
        self.throttle_last: int | None = None
        self.throttle_any = 0

    def add(self, s: GpuSample) -> None:
        self.samples += 1
        values = (
            s.utilization_ratio,
            s.memory_bandwidth_utilization_ratio,
            s.sm_clock_hz,
            s.memory_clock_hz,
            s.temperature_celsius,
            s.power_watts,
        )
        for k, value in enumerate(values):
            if value is None or not isfinite(value):  # one bad read must not poison the tick's mean
                continue
            self.count[k] += 1
            self.total[k] += value
            if value > self.peak[k]:
                self.peak[k] = value
            self.last[k] = value
        if s.memory_used_bytes is not None:
            self.memory_used = s.memory_used_bytes
        if s.memory_total_bytes is not None:
            self.memory_total = s.memory_total_bytes
        if s.throttle_reasons is not None:
            self.throttle_last = s.throttle_reasons
            self.throttle_any |= s.throttle_reasons


@dataclass
class GpuTick:
    """What one GPU contributed to one tick: the drained accumulator plus the latest slow reads."""

    index: int
    acc: GpuAccumulator
    energy_joules: float | None = None
    power_limit_watts: float | None = None
    processes: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NvmlTick:
    """The sampler's state at one drain."""

    up: bool
    error: str | None
    gpus: tuple[GpuTick, ...]
    problems: tuple[str, ...]


_LATEST = ("memory_used_bytes", "memory_total_bytes", "energy_joules", "power_limit_watts")


class _Names:
    """Every flat name of one GPU, built once per index (f-strings per GPU per tick add up)."""

    __slots__ = ("continuous", "other", "prefix", "samples", "throttle", "throttle_reasons")

    def __init__(self, index: int) -> None:
        p = self.prefix = f"nvml.gpu{index}."
        self.samples = p + "samples"
        self.continuous = tuple((f"{p}{m}.mean", f"{p}{m}.max", f"{p}{m}.last") for m in CONTINUOUS)
        self.other = tuple(p + name for name in _LATEST)
        self.throttle_reasons = p + "throttle_reasons"
        self.throttle = tuple((bit, f"{p}throttle.{reason}") for bit, reason in THROTTLE_REASONS)


_NAMES: dict[int, _Names] = {}


def _names(index: int) -> _Names:
    names = _NAMES.get(index)
    if names is None:
        names = _NAMES[index] = _Names(index)
    return names


def build_values(gpus: tuple[GpuTick, ...] | list[GpuTick]) -> dict[str, float]:
    """Flat signal names (see :mod:`detectors.snapshot`) for the GPUs that were sampled in the tick."""
    values: dict[str, float] = {}
    for gpu in gpus:
        acc = gpu.acc
        if acc.samples == 0:
            continue
        names = _names(gpu.index)
        values[names.samples] = float(acc.samples)
        for k, (mean, peak, last) in enumerate(names.continuous):
            if acc.count[k]:
                values[mean] = acc.total[k] / acc.count[k]
                values[peak] = acc.peak[k]
                values[last] = acc.last[k]
        for name, value in zip(
            names.other,
            (acc.memory_used, acc.memory_total, gpu.energy_joules, gpu.power_limit_watts),
            strict=True,
        ):
            if value is not None:
                values[name] = value
        if acc.throttle_last is not None:
            values[names.throttle_reasons] = float(acc.throttle_last)
            for bit, name in names.throttle:
                values[name] = 1.0 if acc.throttle_any & bit else 0.0
        for pid, used in gpu.processes.items():
            values[f"{names.prefix}process_used_bytes.pid{pid}"] = float(used)
    return values
