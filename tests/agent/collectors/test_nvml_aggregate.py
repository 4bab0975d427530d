"""build_values and GpuAccumulator: pure aggregation of samples into flat signal names."""

from __future__ import annotations

import math

from agent.collectors.nvml_aggregate import GpuAccumulator, GpuTick, build_values
from agent.collectors.nvml_backend import THROTTLE_REASONS, GpuSample


def _tick(*samples: GpuSample, index: int = 3, **slow: float) -> GpuTick:
    acc = GpuAccumulator()
    for sample in samples:
        acc.add(sample)
    return GpuTick(index, acc, **slow)  # type: ignore[arg-type]


def test_names_follow_the_snapshot_scheme() -> None:
    values = build_values([_tick(GpuSample(sm_clock_hz=1.5e9))])
    assert set(values) == {f"nvml.gpu3.sm_clock_hz.{agg}" for agg in ("mean", "max", "last")} | {
        "nvml.gpu3.samples"
    }


def test_every_known_throttle_reason_gets_a_zero_or_one() -> None:
    values = build_values([_tick(GpuSample(throttle_reasons=0x40))])
    flags = {name: values[f"nvml.gpu3.throttle.{name}"] for _, name in THROTTLE_REASONS}
    assert flags.pop("hw_thermal_slowdown") == 1.0 and set(flags.values()) == {0.0}


def test_max_of_negative_values_is_not_the_initial_sentinel() -> None:
    values = build_values([_tick(GpuSample(temperature_celsius=-5.0), GpuSample(temperature_celsius=-7.0))])
    assert values["nvml.gpu3.temperature_celsius.max"] == -5.0


def test_infinite_sample_is_not_counted() -> None:
    acc = GpuAccumulator()
    acc.add(GpuSample(power_watts=math.inf))
    assert (acc.samples, acc.count[5]) == (1, 0)


def test_gpu_without_samples_contributes_nothing_even_with_slow_values() -> None:
    assert build_values([GpuTick(0, GpuAccumulator(), energy_joules=5.0)]) == {}


def test_slow_values_and_processes_are_emitted_when_sampled() -> None:
    tick = _tick(GpuSample(), energy_joules=12.5, power_limit_watts=700.0)
    tick.processes = {77: 2048}
    values = build_values([tick])
    assert (values["nvml.gpu3.energy_joules"], values["nvml.gpu3.power_limit_watts"]) == (12.5, 700.0)
    assert values["nvml.gpu3.process_used_bytes.pid77"] == 2048.0
