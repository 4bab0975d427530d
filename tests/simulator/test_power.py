"""Power, power capping and the thermal model."""

from __future__ import annotations

import pytest

from simulator.hardware import gpu_profile
from simulator.power import PowerModel, ThermalModel

A100 = gpu_profile("a100-80g")


def test_compute_bound_step_at_full_clock_draws_near_tdp() -> None:
    power = PowerModel(A100).busy_power(A100.clock_max_mhz, 1.0, 0.3)
    assert 0.85 * A100.tdp_w < power <= A100.tdp_w


def test_power_falls_with_the_clock() -> None:
    model = PowerModel(A100)
    assert model.busy_power(800, 0.5, 0.5) < model.busy_power(1410, 0.5, 0.5)


def test_power_limit_lowers_the_clock_until_it_fits() -> None:
    model = PowerModel(A100)
    clock, capped = model.capped_clock(1410, 250, 1.0, 0.3)
    assert capped and clock < 1410
    assert model.busy_power(clock, 1.0, 0.3) == pytest.approx(250, abs=1.0)


def test_limit_above_draw_leaves_the_clock_alone() -> None:
    assert PowerModel(A100).capped_clock(1410, 400, 0.0, 0.5) == (1410, False)


def test_temperature_approaches_its_steady_state() -> None:
    thermal = ThermalModel(A100)
    thermal.advance(300.0, 10 * A100.thermal_time_constant_s)
    assert thermal.temperature_c == pytest.approx(
        A100.ambient_c + A100.thermal_resistance_c_per_w * 300, abs=0.1
    )


def test_hot_gpu_caps_its_clock() -> None:
    thermal = ThermalModel(A100, temperature_c=A100.slowdown_temp_c + 5)
    assert thermal.clock_cap_mhz() == pytest.approx(A100.clock_max_mhz * 0.6)


def test_cool_gpu_runs_at_full_clock() -> None:
    assert ThermalModel(A100).clock_cap_mhz() == A100.clock_max_mhz
