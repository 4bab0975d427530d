"""GPU control backends: real NVML (``pynvml``) and a simulated GPU kept in a JSON file.

Both speak base-unit-ish NVML terms: watts for power limits, MHz for clocks (NVML's own clock unit; the
knob is a clock, not a frequency signal). The simulated backend stores its state in a file so that a
test in another process can check that a signalled agent really restored the defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol


class GpuControlError(Exception):
    """A GPU control call failed; ``str(error)`` is one readable line."""


class GpuBackend(Protocol):
    def gpu_indices(self) -> list[int]: ...
    def gpu_uuid(self, index: int) -> str: ...
    def power_limit_w(self, index: int) -> float: ...
    def power_limit_bounds_w(self, index: int) -> tuple[float, float]: ...
    def default_power_limit_w(self, index: int) -> float: ...
    def set_power_limit_w(self, index: int, watts: float) -> None: ...
    def clock_bounds_mhz(self, index: int) -> tuple[float, float]: ...
    def locked_max_clock_mhz(self, index: int) -> float | None: ...
    def lock_clocks_mhz(self, index: int, low: float, high: float) -> None: ...
    def reset_clocks(self, index: int) -> None: ...


def permission_problem(euid: int | None = None, status_text: str | None = None) -> str | None:
    """Why this process may not change GPU clocks or power limits, or None when it may.

    NVML's set calls need root or ``CAP_SYS_ADMIN`` (bit 21 of the effective capability set in
    ``/proc/self/status``); checking up front gives one clear line instead of an NVML ``NoPermission``
    at the first action.
    """
    euid = os.geteuid() if euid is None else euid
    if euid == 0:
        return None
    if status_text is None:
        try:
            status_text = Path("/proc/self/status").read_text()
        except OSError:
            status_text = ""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            if int(line.split()[1], 16) & (1 << 21):
                return None
            break
    return "changing GPU clocks or power limits needs root or CAP_SYS_ADMIN (add it to the container)"


@dataclass
class SimulatedGpu:
    power_limit_w: float = 400.0
    default_power_limit_w: float = 400.0
    min_power_limit_w: float = 100.0
    max_power_limit_w: float = 400.0
    clock_min_mhz: float = 210.0
    clock_max_mhz: float = 1410.0
    locked_max_clock_mhz: float | None = None
    uuid: str = ""


class SimulatedGpuBackend:
    """GPUs as plain data (A100-80G limits by default), optionally mirrored to ``state_file``."""

    def __init__(self, count: int = 1, state_file: str | Path | None = None) -> None:
        self.path = Path(state_file) if state_file else None
        self.gpus = [SimulatedGpu() for _ in range(count)]
        if self.path is not None and self.path.exists():
            self.gpus = [SimulatedGpu(**g) for g in json.loads(self.path.read_text())["gpus"]]
        self._save()

    @staticmethod
    def read_state(path: str | Path) -> list[dict[str, Any]]:
        gpus: list[dict[str, Any]] = json.loads(Path(path).read_text())["gpus"]
        return gpus

    def _save(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"gpus": [asdict(g) for g in self.gpus]}))
            tmp.replace(self.path)  # atomic: a reader never sees half a file

    def _gpu(self, index: int) -> SimulatedGpu:
        if not 0 <= index < len(self.gpus):
            raise GpuControlError(f"gpu{index}: no such GPU")
        return self.gpus[index]

    def gpu_indices(self) -> list[int]:
        return list(range(len(self.gpus)))

    def gpu_uuid(self, index: int) -> str:
        return self._gpu(index).uuid

    def power_limit_w(self, index: int) -> float:
        return self._gpu(index).power_limit_w

    def power_limit_bounds_w(self, index: int) -> tuple[float, float]:
        gpu = self._gpu(index)
        return gpu.min_power_limit_w, gpu.max_power_limit_w

    def default_power_limit_w(self, index: int) -> float:
        return self._gpu(index).default_power_limit_w

    def set_power_limit_w(self, index: int, watts: float) -> None:
        self._gpu(index).power_limit_w = watts
        self._save()

    def clock_bounds_mhz(self, index: int) -> tuple[float, float]:
        gpu = self._gpu(index)
        return gpu.clock_min_mhz, gpu.clock_max_mhz

    def locked_max_clock_mhz(self, index: int) -> float | None:
        return self._gpu(index).locked_max_clock_mhz

    def lock_clocks_mhz(self, index: int, low: float, high: float) -> None:
        self._gpu(index).locked_max_clock_mhz = high
        self._save()

    def reset_clocks(self, index: int) -> None:
        self._gpu(index).locked_max_clock_mhz = None
        self._save()


class NvmlGpuBackend:
    """Real GPUs through ``pynvml`` (imported here only, so nothing else needs the driver)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as error:  # pragma: no cover - installed with the package
            raise GpuControlError(f"nvidia-ml-py is not installed: {error}") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as error:
            raise GpuControlError(f"NVML unavailable: {error}") from None
        self._locked: dict[int, float] = {}

    def _call(self, index: int, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(self._handles[index], *args)
        except self._nv.NVMLError as error:
            raise GpuControlError(f"gpu{index}: {what}: {error}") from None

    def gpu_indices(self) -> list[int]:
        return list(range(len(self._handles)))

    def gpu_uuid(self, index: int) -> str:
        raw = self._call(index, "read UUID", self._nv.nvmlDeviceGetUUID)
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def power_limit_w(self, index: int) -> float:
        return float(self._call(index, "read power limit", self._nv.nvmlDeviceGetPowerManagementLimit)) / 1000

    def power_limit_bounds_w(self, index: int) -> tuple[float, float]:
        lo, hi = self._call(index, "read limits", self._nv.nvmlDeviceGetPowerManagementLimitConstraints)
        return lo / 1000, hi / 1000

    def default_power_limit_w(self, index: int) -> float:
        mw = self._call(index, "read default limit", self._nv.nvmlDeviceGetPowerManagementDefaultLimit)
        return float(mw) / 1000

    def set_power_limit_w(self, index: int, watts: float) -> None:
        self._call(index, "set power limit", self._nv.nvmlDeviceSetPowerManagementLimit, round(watts * 1000))

    def clock_bounds_mhz(self, index: int) -> tuple[float, float]:
        mem = self._call(index, "read memory clocks", self._nv.nvmlDeviceGetSupportedMemoryClocks)
        clocks = self._call(index, "read clocks", self._nv.nvmlDeviceGetSupportedGraphicsClocks, max(mem))
        return float(min(clocks)), float(max(clocks))

    def locked_max_clock_mhz(self, index: int) -> float | None:
        return self._locked.get(index)  # NVML has no getter for locked clocks; remember what we set

    def lock_clocks_mhz(self, index: int, low: float, high: float) -> None:
        self._call(index, "lock clocks", self._nv.nvmlDeviceSetGpuLockedClocks, int(low), int(high))
        self._locked[index] = high

    def reset_clocks(self, index: int) -> None:
        self._call(index, "reset clocks", self._nv.nvmlDeviceResetGpuLockedClocks)
        self._locked.pop(index, None)
