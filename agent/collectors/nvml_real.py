"""Real NVML through nvidia-ml-py (module ``pynvml``).

Each field is read by its own call so that one unsupported field (instant power on a pre-Hopper board,
energy on a consumer card) drops that field only. Errors are classified by NVML return code:

=================================================  ==========================================
code                                               effect
=================================================  ==========================================
NotSupported, FunctionNotFound, NoPermission       field is ``None`` and is not asked again
GpuIsLost                                          :class:`GpuLostError` (that GPU only)
Uninitialized, DriverNotLoaded, LibraryNotFound,   :class:`NvmlUnavailableError` (re-init with
LibRmVersionMismatch                               backoff)
anything else (Unknown, Timeout, ...)              field is ``None`` for this read only
=================================================  ==========================================

Remembering unsupported fields matters for cost: an unsupported call still crosses into the driver, and at
10 Hz on 8 GPUs every wasted call is 80 per second.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import pynvml

from agent.collectors.nvml_backend import GpuInfo, GpuLostError, GpuSample, NvmlUnavailableError

log = logging.getLogger(__name__)

_UNSUPPORTED = frozenset(
    {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NO_PERMISSION}
)
_FATAL = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)
#: ``c_nvmlFieldValue_t.valueType`` -> the member of the ``value`` union that holds it.
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}
_INSTANT_POWER_FIELD = [pynvml.NVML_FI_DEV_POWER_INSTANT]


def _text(value: str | bytes) -> str:
    """pynvml returns ``bytes`` from older releases and ``str`` from newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _code(error: pynvml.NVMLError) -> int:
    return int(getattr(error, "value", pynvml.NVML_ERROR_UNKNOWN))


def field_value(entry: Any) -> float:
    """The number in one ``c_nvmlFieldValue_t``, read from the union member its ``valueType`` names."""
    return float(getattr(entry.value, _VALUE_MEMBER.get(int(entry.valueType), "ullVal")))


class _Device:
    __slots__ = ("handle", "index", "unsupported")

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.unsupported: set[str] = set()


class RealNvmlBackend:
    """:class:`~agent.collectors.nvml_backend.NvmlBackend` over the NVIDIA driver."""

    kind = "nvml"

    def __init__(self) -> None:
        self._devices: dict[int, _Device] = {}
        self._initialised = False

    def init(self) -> list[GpuInfo]:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as error:
            hint = ""
            if _code(error) in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
                hint = " (no NVIDIA driver on this node? set nvml.backend to simulated or off)"
            raise NvmlUnavailableError(f"NVML init failed: {error}{hint}") from None
        self._initialised = True
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            infos: list[GpuInfo] = []
            self._devices = {}
            for index in range(int(pynvml.nvmlDeviceGetCount())):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    name = _text(pynvml.nvmlDeviceGetName(handle))
                    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                except pynvml.NVMLError as error:
                    if _code(error) in _FATAL:
                        raise
                    # One broken GPU must not hide the healthy ones.
                    log.warning("nvml: skipping gpu%d at init: %s", index, error)
                    continue
                self._devices[index] = _Device(index, handle)
                infos.append(GpuInfo(index, name, uuid, driver))
        except pynvml.NVMLError as error:
            self.shutdown()
            raise NvmlUnavailableError(f"NVML device enumeration failed: {error}") from None
        return infos

    def shutdown(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        self._devices = {}
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as error:
            log.debug("nvml: nvmlShutdown failed: %s", error)

    def begin_round(self) -> None:
        """Nothing to prefetch: NVML calls are per device."""

    def _device(self, index: int) -> _Device:
        device = self._devices.get(index)
        if device is None:
            raise GpuLostError(index, "not known to NVML (re-initialise to rediscover)")
        return device

    def _read(self, device: _Device, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)``; ``None`` when the field is (or just turned out to be) unavailable."""
        if field in device.unsupported:
            return None
        try:
            return fn(*args)
        except pynvml.NVMLError as error:
            self._classify(device, field, _code(error), error)
            return None

    def _classify(self, device: _Device, field: str, code: int, error: object) -> None:
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:
            raise GpuLostError(device.index, f"GPU is lost (reading {field})")
        if code in _FATAL:
            raise NvmlUnavailableError(f"NVML failed reading gpu{device.index} {field}: {error}")
        if code in _UNSUPPORTED:
            log.info("nvml: gpu%d does not support %s (%s); dropping that field", device.index, field, error)
            device.unsupported.add(field)

    def _instant_power_w(self, device: _Device) -> float | None:
        entries = self._read(
            device, "power_instant", pynvml.nvmlDeviceGetFieldValues, device.handle, _INSTANT_POWER_FIELD
        )
        if entries is None:
            return None
        entry = entries[0]
        code = int(entry.nvmlReturn)
        if code != pynvml.NVML_SUCCESS:
            # The call succeeded but the field did not: its own return code says why.
            self._classify(device, "power_instant", code, pynvml.NVMLError(code))
            return None
        return field_value(entry) / 1000.0

    def sample(self, index: int, slow: bool) -> GpuSample:
        device = self._device(index)
        handle = device.handle
        out = GpuSample()
        util = self._read(device, "utilization", pynvml.nvmlDeviceGetUtilizationRates, handle)
        if util is not None:
            out.utilization_ratio = util.gpu / 100.0
            out.memory_bandwidth_utilization_ratio = util.memory / 100.0
        sm = self._read(device, "sm_clock", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
        if sm is not None:
            out.sm_clock_hz = sm * 1e6
        mem = self._read(device, "mem_clock", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM)
        if mem is not None:
            out.memory_clock_hz = mem * 1e6
        temp = self._read(
            device, "temperature", pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
        )
        if temp is not None:
            out.temperature_celsius = float(temp)
        power = self._instant_power_w(device)
        if power is None:
            usage_mw = self._read(device, "power_usage", pynvml.nvmlDeviceGetPowerUsage, handle)
            power = None if usage_mw is None else usage_mw / 1000.0
        out.power_watts = power
        memory = self._read(device, "memory", pynvml.nvmlDeviceGetMemoryInfo, handle)
        if memory is not None:
            out.memory_used_bytes = float(memory.used)
            out.memory_total_bytes = float(memory.total)
        reasons = self._read(
            device, "clocks_event_reasons", pynvml.nvmlDeviceGetCurrentClocksEventReasons, handle
        )
        if reasons is None:
            # Drivers before 535 only have the older name for the same bitmask.
            reasons = self._read(
                device, "clocks_throttle_reasons", pynvml.nvmlDeviceGetCurrentClocksThrottleReasons, handle
            )
        if reasons is not None:
            out.throttle_reasons = int(reasons)
        if slow:
            energy_mj = self._read(device, "energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy_mj is not None:
                out.energy_joules = energy_mj / 1000.0
            limit_mw = self._read(device, "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            if limit_mw is not None:
                out.power_limit_watts = limit_mw / 1000.0
        return out

    def processes(self, index: int) -> Mapping[int, int]:
        device = self._device(index)
        used: dict[int, int] = {}
        for field, fn in (
            ("compute_processes", pynvml.nvmlDeviceGetComputeRunningProcesses),
            ("graphics_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            for proc in self._read(device, field, fn, device.handle) or ():
                memory = getattr(proc, "usedGpuMemory", None)
                if memory is None:  # WDDM and some MIG setups cannot attribute memory to a process
                    continue
                # A process in both lists reports the same allocation twice; count it once.
                used[int(proc.pid)] = max(used.get(int(proc.pid), 0), int(memory))
        return used
