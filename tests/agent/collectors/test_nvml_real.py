"""RealNvmlBackend against pynvml functions monkeypatched to behave like a driver (there is no GPU here).

Errors are real ``pynvml.NVMLError`` subclasses and values are pynvml's own ctypes structures, so the
backend sees exactly the types the library hands it on a GPU node.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from agent.collectors.nvml_backend import GpuLostError, NvmlUnavailableError
from agent.collectors.nvml_real import RealNvmlBackend

MIB = 1 << 20


def _instant_power(milliwatts: int, ret: int = pynvml.NVML_SUCCESS) -> Any:
    entry = pynvml.c_nvmlFieldValue_t()
    entry.fieldId = pynvml.NVML_FI_DEV_POWER_INSTANT
    entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    entry.nvmlReturn = ret
    entry.value.uiVal = milliwatts
    return (entry,)


class Driver:
    """A two-GPU driver: every pynvml call the backend makes, with call counts and error switches."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        self.errors: dict[str, type[pynvml.NVMLError]] = {}
        self.instant_ret = pynvml.NVML_SUCCESS
        funcs = {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlSystemGetDriverVersion": lambda: b"550.54.15",
            "nvmlDeviceGetCount": lambda: 2,
            "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
            "nvmlDeviceGetName": lambda h: "NVIDIA H100 80GB HBM3",
            "nvmlDeviceGetUUID": lambda h: f"GPU-uuid-{h[-1]}",
            "nvmlDeviceGetUtilizationRates": lambda h: pynvml.c_nvmlUtilization_t(gpu=87, memory=41),
            "nvmlDeviceGetClockInfo": lambda h, t: 1755 if t == pynvml.NVML_CLOCK_SM else 2619,
            "nvmlDeviceGetTemperature": lambda h, s: 64,
            "nvmlDeviceGetFieldValues": lambda h, ids: _instant_power(612_500, self.instant_ret),
            "nvmlDeviceGetPowerUsage": lambda h: 598_000,
            "nvmlDeviceGetMemoryInfo": lambda h: pynvml.c_nvmlMemory_t(
                total=81_559 * MIB, free=8_000 * MIB, used=73_559 * MIB
            ),
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: 0x24,
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: 0x04,
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: 18_234_567_125,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
            "nvmlDeviceGetComputeRunningProcesses": lambda h: [
                SimpleNamespace(pid=4242, usedGpuMemory=70_000 * MIB),
                SimpleNamespace(pid=4250, usedGpuMemory=None),
            ],
            "nvmlDeviceGetGraphicsRunningProcesses": lambda h: [
                SimpleNamespace(pid=4242, usedGpuMemory=70_000 * MIB),
                SimpleNamespace(pid=31, usedGpuMemory=12 * MIB),
            ],
        }
        for name, fn in funcs.items():
            monkeypatch.setattr(pynvml, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.errors:
                raise self.errors[name]()
            return fn(*args)

        return call


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Driver:
    return Driver(monkeypatch)


@pytest.fixture
def backend(driver: Driver) -> RealNvmlBackend:
    real = RealNvmlBackend()
    real.init()
    return real


def test_init_lists_gpus_with_decoded_names_and_driver(driver: Driver) -> None:
    infos = RealNvmlBackend().init()
    assert [(i.index, i.uuid, i.driver_version) for i in infos] == [
        (0, "GPU-uuid-0", "550.54.15"),
        (1, "GPU-uuid-1", "550.54.15"),
    ]


def test_library_not_found_is_unavailable_with_a_hint(driver: Driver) -> None:
    driver.errors["nvmlInit"] = pynvml.NVMLError_LibraryNotFound
    with pytest.raises(NvmlUnavailableError, match=r"Library Not Found.*nvml\.backend"):
        RealNvmlBackend().init()


def test_driver_not_loaded_is_unavailable(driver: Driver) -> None:
    driver.errors["nvmlInit"] = pynvml.NVMLError_DriverNotLoaded
    with pytest.raises(NvmlUnavailableError, match="Driver Not Loaded"):
        RealNvmlBackend().init()


def test_gpu_failing_at_init_is_skipped_and_others_kept(
    driver: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    def uuid(handle: str) -> str:
        if handle == "handle0":
            raise pynvml.NVMLError_GpuIsLost()
        return "GPU-uuid-1"

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", uuid)
    assert [i.index for i in RealNvmlBackend().init()] == [1]


def test_sample_converts_to_base_units(backend: RealNvmlBackend) -> None:
    s = backend.sample(0, slow=False)
    assert (s.utilization_ratio, s.memory_bandwidth_utilization_ratio) == (0.87, 0.41)
    assert (s.sm_clock_hz, s.memory_clock_hz) == (1.755e9, 2.619e9)
    assert (s.temperature_celsius, s.power_watts) == (64.0, 612.5)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (73_559 * MIB, 81_559 * MIB)
    assert s.throttle_reasons == 0x24


def test_fast_sample_skips_energy_and_power_limit(backend: RealNvmlBackend, driver: Driver) -> None:
    s = backend.sample(0, slow=False)
    assert (s.energy_joules, s.power_limit_watts) == (None, None)
    assert "nvmlDeviceGetTotalEnergyConsumption" not in driver.calls


def test_slow_sample_reads_energy_in_joules_and_power_limit(backend: RealNvmlBackend) -> None:
    s = backend.sample(0, slow=True)
    assert s.energy_joules == pytest.approx(18_234_567.125)
    assert s.power_limit_watts == 700.0


def test_instant_power_not_supported_falls_back_to_power_usage(
    backend: RealNvmlBackend, driver: Driver
) -> None:
    driver.instant_ret = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert backend.sample(0, slow=False).power_watts == 598.0


def test_unsupported_instant_power_is_not_asked_again(backend: RealNvmlBackend, driver: Driver) -> None:
    driver.errors["nvmlDeviceGetFieldValues"] = pynvml.NVMLError_NotSupported
    backend.sample(0, slow=False)
    backend.sample(0, slow=False)
    assert driver.calls["nvmlDeviceGetFieldValues"] == 1
    assert driver.calls["nvmlDeviceGetPowerUsage"] == 2


def test_unsupported_field_drops_that_field_only(backend: RealNvmlBackend, driver: Driver) -> None:
    driver.errors["nvmlDeviceGetTemperature"] = pynvml.NVMLError_NotSupported
    s = backend.sample(0, slow=True)
    assert s.temperature_celsius is None
    assert s.power_watts == 612.5 and s.energy_joules is not None


def test_transient_error_drops_the_field_for_one_read_only(backend: RealNvmlBackend, driver: Driver) -> None:
    driver.errors["nvmlDeviceGetTemperature"] = pynvml.NVMLError_Unknown
    assert backend.sample(0, slow=False).temperature_celsius is None
    del driver.errors["nvmlDeviceGetTemperature"]
    assert backend.sample(0, slow=False).temperature_celsius == 64.0


def test_gpu_is_lost_raises_gpu_lost_with_its_index(backend: RealNvmlBackend, driver: Driver) -> None:
    driver.errors["nvmlDeviceGetUtilizationRates"] = pynvml.NVMLError_GpuIsLost
    with pytest.raises(GpuLostError) as caught:
        backend.sample(1, slow=False)
    assert caught.value.index == 1


def test_driver_unloaded_mid_run_is_unavailable(backend: RealNvmlBackend, driver: Driver) -> None:
    driver.errors["nvmlDeviceGetClockInfo"] = pynvml.NVMLError_DriverNotLoaded
    with pytest.raises(NvmlUnavailableError):
        backend.sample(0, slow=False)


def test_old_driver_without_clocks_event_api_uses_throttle_reasons(
    backend: RealNvmlBackend, driver: Driver
) -> None:
    driver.errors["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVMLError_FunctionNotFound
    assert backend.sample(0, slow=False).throttle_reasons == 0x04


def test_processes_merge_compute_and_graphics_once_per_pid(backend: RealNvmlBackend) -> None:
    assert backend.processes(0) == {4242: 70_000 * MIB, 31: 12 * MIB}


def test_shutdown_calls_nvml_shutdown_once_and_swallows_errors(
    backend: RealNvmlBackend, driver: Driver
) -> None:
    driver.errors["nvmlShutdown"] = pynvml.NVMLError_Uninitialized
    backend.shutdown()
    backend.shutdown()
    assert driver.calls["nvmlShutdown"] == 1
