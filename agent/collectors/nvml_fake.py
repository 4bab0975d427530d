"""An in-process NVML backend for tests and benchmarks. Never selected by config.

:class:`FakeNvmlBackend` produces plausible H100-class numbers without a GPU and with switches for every
failure the sampler must survive, so tests can drive the sampler deterministically and ``bench/tick.py``
can measure the sampler's own CPU cost on 8 GPUs (the fake is cheap, so what is measured is the sampler).

Values move with the round number, not with a clock, so the same calls always give the same numbers::

    util(gpu, r)  = 0.55 + 0.40 * sin(0.07 r + gpu)         (0.15 .. 0.95)
    power(gpu, r) = idle + (limit - idle) * util * 0.9      (W)
    energy       += power * round_s                         (J, monotonic)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from agent.collectors.nvml_backend import (
    GpuInfo,
    GpuLostError,
    GpuSample,
    NvmlUnavailableError,
)

GIB = 1 << 30


class FakeNvmlBackend:
    """A scripted :class:`~agent.collectors.nvml_backend.NvmlBackend` with failure switches.

    Switches (plain attributes, flip them between calls):

    * ``library_missing``: ``init``/``begin_round`` raise :class:`NvmlUnavailableError` as real NVML does
      without a driver;
    * ``unsupported``: sample fields (``GpuSample`` attribute names) the GPUs "cannot report" (``None``),
      e.g. ``{"power_watts"}``;
    * ``lost``: GPU indices that raise :class:`GpuLostError`;
    * ``processes_by_gpu``: per-GPU ``{pid: bytes}``;
    * ``values``: optional ``values(gpu, round) -> GpuSample`` replacing the built-in waveform.

    Counters ``init_calls``, ``shutdown_calls``, ``rounds``, ``sample_calls`` and ``process_calls`` let
    tests check how often the sampler touches the backend.
    """

    kind = "fake"

    def __init__(
        self,
        gpu_count: int = 8,
        *,
        driver_version: str = "550.54.15",
        round_s: float = 0.1,
        values: Callable[[int, int], GpuSample] | None = None,
    ) -> None:
        self.gpu_count = gpu_count
        self.driver_version = driver_version
        self.round_s = round_s
        self.values = values
        self.library_missing = False
        self.unsupported: set[str] = set()
        self.lost: set[int] = set()
        self.processes_by_gpu: dict[int, dict[int, int]] = {
            i: {1000 + i: 60 * GIB, 2000 + i: 512 << 20} for i in range(gpu_count)
        }
        self.init_calls = 0
        self.shutdown_calls = 0
        self.rounds = 0
        self.sample_calls = 0
        self.process_calls = 0
        self._energy_j = [1.0e6 * (i + 1) for i in range(gpu_count)]
        self._initialised = False

    def init(self) -> list[GpuInfo]:
        self.init_calls += 1
        if self.library_missing:
            raise NvmlUnavailableError("NVML init failed: NVML Shared Library Not Found (fake)")
        self._initialised = True
        return [
            GpuInfo(i, "NVIDIA H100 80GB HBM3", f"GPU-fake-{i:04d}", self.driver_version)
            for i in range(self.gpu_count)
        ]

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        self._initialised = False

    def begin_round(self) -> None:
        if self.library_missing or not self._initialised:
            raise NvmlUnavailableError("NVML failed: Driver Not Loaded (fake)")
        self.rounds += 1

    def _check(self, index: int) -> None:
        if index in self.lost:
            raise GpuLostError(index, "GPU is lost (fake)")
        if not 0 <= index < self.gpu_count:
            raise GpuLostError(index, "no such GPU (fake)")

    def _waveform(self, index: int, slow: bool) -> GpuSample:
        util = 0.55 + 0.40 * math.sin(0.07 * self.rounds + index)
        power = 70.0 + (700.0 - 70.0) * util * 0.9
        self._energy_j[index] += power * self.round_s
        return GpuSample(
            utilization_ratio=util,
            memory_bandwidth_utilization_ratio=util * 0.6,
            sm_clock_hz=1.98e9 - 4.0e8 * util * util,
            memory_clock_hz=2.619e9,
            temperature_celsius=38.0 + 35.0 * util,
            power_watts=power,
            memory_used_bytes=float(61 * GIB),
            memory_total_bytes=float(80 * GIB),
            throttle_reasons=0x004 if util > 0.9 else 0,
            energy_joules=self._energy_j[index] if slow else None,
            power_limit_watts=700.0 if slow else None,
        )

    def sample(self, index: int, slow: bool) -> GpuSample:
        self._check(index)
        self.sample_calls += 1
        out = self.values(index, self.rounds) if self.values else self._waveform(index, slow)
        if not slow:  # the Protocol's contract, whatever a scripted ``values`` returns
            out.energy_joules = out.power_limit_watts = None
        for name in self.unsupported:
            setattr(out, name, None)
        return out

    def processes(self, index: int) -> Mapping[int, int]:
        self._check(index)
        self.process_calls += 1
        return self.processes_by_gpu.get(index, {})
