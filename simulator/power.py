"""SM clock, power and temperature: the physics behind the clock and power-limit knobs.

Power of a busy GPU at SM clock ``f`` (``x = f / f_max``)::

    v(f) = v_min + (1 - v_min) (f - f_min) / (f_max - f_min)     DVFS: voltage follows the clock
    P    = P_idle + P_core a x v(f)^2 + P_mem m                   CMOS dynamic power ~ f V^2
    a    = 0.45 + 0.55 c                                          c: compute share of the step time
                                                                  m: HBM-bandwidth share of the step time

Step time falls as ``1/f`` only while the step is compute-bound or the clock is below the HBM knee, so
energy per token ``P t / tokens`` is U-shaped over the clock: at low clocks static power is paid for a
long time, at high clocks ``f V^2`` grows faster than the step shortens.

A power limit is honoured the way the driver does it (clocks-event reason SW power cap): the clock is
lowered until ``P <= limit``. Temperature is first order, ``tau dT/dt = T_amb + R P - T``, integrated
exactly over each interval; above the slowdown temperature the clock is capped (SW thermal slowdown).
"""

from __future__ import annotations

import math

from simulator.hardware import GpuProfile

V_MIN = 0.7
SPIN_ACTIVITY = 0.2
"""A hung collective's spin kernels, as a share of the core's full dynamic power (a step's floor is 0.45)."""
#: NVML clocks-event (throttle) reason bits.
REASON_GPU_IDLE = 0x1
REASON_APPLICATIONS_CLOCKS = 0x2
REASON_SW_POWER_CAP = 0x4
REASON_SW_THERMAL = 0x20
#: Clock lost per degree above the slowdown temperature (share of f_max).
THERMAL_SLOPE_PER_C = 0.08


class PowerModel:
    """Busy and idle power of one GPU, and the clock a power limit allows."""

    def __init__(self, gpu: GpuProfile) -> None:
        self.gpu = gpu
        self._fmin = gpu.clock_min_mhz
        self._fmax = gpu.clock_max_mhz

    def voltage(self, clock_mhz: float) -> float:
        """Relative core voltage (1 at f_max) on the DVFS curve."""
        span = self._fmax - self._fmin
        return V_MIN + (1.0 - V_MIN) * (clock_mhz - self._fmin) / span

    def busy_power(self, clock_mhz: float, compute_share: float, mem_share: float) -> float:
        """Watts drawn while a step runs at ``clock_mhz``."""
        x = clock_mhz / self._fmax
        v = self.voltage(clock_mhz)
        activity = 0.45 + 0.55 * compute_share
        gpu = self.gpu
        return gpu.idle_power_w + gpu.core_dynamic_w * activity * x * v * v + gpu.memory_dynamic_w * mem_share

    def spin_power(self, clock_mhz: float) -> float:
        """Watts drawn by a hung collective's spin kernels: a few SMs polling memory keep the GPU "busy"
        at ``clock_mhz``, a fraction of a step's dynamic power above idle (an NCCL hang on an H100
        reads 100% utilisation at 150-200 W)."""
        x = clock_mhz / self._fmax
        v = self.voltage(clock_mhz)
        return self.gpu.idle_power_w + self.gpu.core_dynamic_w * SPIN_ACTIVITY * x * v * v

    @property
    def idle_power(self) -> float:
        return self.gpu.idle_power_w

    def capped_clock(
        self, requested_mhz: float, limit_w: float, compute_share: float, mem_share: float
    ) -> tuple[float, bool]:
        """The highest clock <= ``requested_mhz`` whose busy power fits ``limit_w``; and whether the cap
        bound. Power rises monotonically with the clock, so bisection finds it in a few iterations."""
        if self.busy_power(requested_mhz, compute_share, mem_share) <= limit_w:
            return requested_mhz, False
        lo, hi = self._fmin, requested_mhz
        if self.busy_power(lo, compute_share, mem_share) > limit_w:
            return lo, True
        for _ in range(18):
            mid = 0.5 * (lo + hi)
            if self.busy_power(mid, compute_share, mem_share) <= limit_w:
                lo = mid
            else:
                hi = mid
        return lo, True


class ThermalModel:
    """First-order die temperature with a slowdown clock cap."""

    __slots__ = ("gpu", "temperature_c")

    def __init__(self, gpu: GpuProfile, temperature_c: float | None = None) -> None:
        self.gpu = gpu
        self.temperature_c = gpu.ambient_c + gpu.thermal_resistance_c_per_w * gpu.idle_power_w
        if temperature_c is not None:
            self.temperature_c = temperature_c

    def advance(self, power_w: float, dt_s: float, ambient_c: float | None = None) -> float:
        """Integrate ``dt_s`` seconds at constant ``power_w`` exactly; returns the new temperature."""
        gpu = self.gpu
        amb = gpu.ambient_c if ambient_c is None else ambient_c
        steady = amb + gpu.thermal_resistance_c_per_w * power_w
        decay = math.exp(-dt_s / gpu.thermal_time_constant_s) if dt_s > 0 else 1.0
        self.temperature_c = steady + (self.temperature_c - steady) * decay
        return self.temperature_c

    def clock_cap_mhz(self) -> float:
        """Highest clock the thermal governor allows now (f_max below the slowdown temperature)."""
        gpu = self.gpu
        over = self.temperature_c - gpu.slowdown_temp_c
        if over <= 0:
            return gpu.clock_max_mhz
        share = max(0.0, 1.0 - THERMAL_SLOPE_PER_C * over)
        return max(gpu.clock_min_mhz, gpu.clock_max_mhz * share)
