"""Simulated NVML: the simulator's ``GET {nvml.simulated_url}/sim/nvml`` JSON, read over HTTP.

Contract (served by :mod:`simulator`)::

    {"driver_version": str,
     "gpus": [{"index": 0, "name": str, "uuid": str,
               "utilization_gpu_ratio": float, "utilization_memory_ratio": float,
               "sm_clock_mhz": float, "mem_clock_mhz": float, "temperature_c": float,
               "power_w": float, "power_limit_w": float, "energy_j": float,
               "memory_used_bytes": int, "memory_total_bytes": int,
               "throttle_reasons": int,            # NVML clocks-event bitmask
               "processes": [{"pid": int, "used_memory_bytes": int}]}]}

The sampler runs in its own thread, so this backend uses the stdlib's blocking ``urllib.request`` with a
short timeout, and fetches once per sampling round (:meth:`begin_round`), not once per GPU. Parsing is the
pure :func:`parse_payload`. A missing, non-numeric or non-finite field drops that field only (as NVML's
``NotSupported`` would); a malformed document or an unreachable simulator makes the backend unavailable.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from agent.collectors.nvml_backend import GpuInfo, GpuLostError, GpuSample, NvmlUnavailableError

#: A real 8-GPU document is ~5 KiB; refusing huge bodies keeps a confused server from eating memory.
MAX_BODY_BYTES = 1 << 20

#: (JSON key, GpuSample attribute, scale to base units)
_FIELDS: tuple[tuple[str, str, float], ...] = (
    ("utilization_gpu_ratio", "utilization_ratio", 1.0),
    ("utilization_memory_ratio", "memory_bandwidth_utilization_ratio", 1.0),
    ("sm_clock_mhz", "sm_clock_hz", 1e6),
    ("mem_clock_mhz", "memory_clock_hz", 1e6),
    ("temperature_c", "temperature_celsius", 1.0),
    ("power_w", "power_watts", 1.0),
    ("power_limit_w", "power_limit_watts", 1.0),
    ("energy_j", "energy_joules", 1.0),
    ("memory_used_bytes", "memory_used_bytes", 1.0),
    ("memory_total_bytes", "memory_total_bytes", 1.0),
)


@dataclass(frozen=True)
class SimulatedGpu:
    """One GPU of one simulated-NVML document."""

    info: GpuInfo
    sample: GpuSample
    processes: Mapping[int, int] = field(default_factory=dict)


def _number(value: Any) -> float | None:
    # bool is an int in Python but never a measurement.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _processes(raw: Any) -> dict[int, int]:
    used: dict[int, int] = {}
    if not isinstance(raw, list):
        return used
    for entry in raw:
        if not isinstance(entry, dict):
            continue
        pid, memory = entry.get("pid"), _number(entry.get("used_memory_bytes"))
        if isinstance(pid, int) and not isinstance(pid, bool) and memory is not None and memory >= 0:
            used[pid] = max(used.get(pid, 0), int(memory))
    return used


def parse_payload(document: Any) -> dict[int, SimulatedGpu]:
    """The GPUs of one ``/sim/nvml`` document, by index. Raises :class:`NvmlUnavailableError` on bad shape."""
    if not isinstance(document, dict):
        raise NvmlUnavailableError(f"simulated NVML: expected a JSON object, got {type(document).__name__}")
    gpus = document.get("gpus")
    if not isinstance(gpus, list):
        raise NvmlUnavailableError("simulated NVML: 'gpus' must be a list")
    driver = str(document.get("driver_version", "unknown"))
    parsed: dict[int, SimulatedGpu] = {}
    for position, raw in enumerate(gpus):
        if not isinstance(raw, dict):
            raise NvmlUnavailableError(f"simulated NVML: gpus[{position}] must be an object")
        index = raw.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise NvmlUnavailableError(f"simulated NVML: gpus[{position}].index must be an int >= 0")
        if index in parsed:
            raise NvmlUnavailableError(f"simulated NVML: gpu index {index} appears twice")
        sample = GpuSample()
        for key, attr, scale in _FIELDS:
            number = _number(raw.get(key))
            if number is not None:
                setattr(sample, attr, number * scale)
        reasons = raw.get("throttle_reasons")
        if isinstance(reasons, int) and not isinstance(reasons, bool) and reasons >= 0:
            sample.throttle_reasons = reasons
        info = GpuInfo(index, str(raw.get("name", "")), str(raw.get("uuid", "")), driver)
        parsed[index] = SimulatedGpu(info, sample, _processes(raw.get("processes")))
    return parsed


class SimulatedNvmlBackend:
    """:class:`~agent.collectors.nvml_backend.NvmlBackend` over the simulator's HTTP endpoint."""

    kind = "simulated"

    def __init__(self, base_url: str, timeout_s: float = 0.5) -> None:
        self.url = base_url.rstrip("/") + "/sim/nvml"
        self.timeout_s = timeout_s
        # No proxies: the simulator is local, and an HTTP_PROXY in the pod must not capture loopback.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._round: dict[int, SimulatedGpu] = {}

    def _fetch(self) -> dict[int, SimulatedGpu]:
        try:
            with self._opener.open(self.url, timeout=self.timeout_s) as response:
                body = response.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as error:
            raise NvmlUnavailableError(f"simulated NVML {self.url}: HTTP {error.code}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise NvmlUnavailableError(f"simulated NVML {self.url} unreachable: {reason}") from None
        if len(body) > MAX_BODY_BYTES:
            raise NvmlUnavailableError(f"simulated NVML {self.url}: body larger than {MAX_BODY_BYTES} bytes")
        try:
            document = json.loads(body)
        except ValueError as error:
            raise NvmlUnavailableError(f"simulated NVML {self.url}: invalid JSON ({error})") from None
        return parse_payload(document)

    def init(self) -> list[GpuInfo]:
        self._round = self._fetch()
        return [gpu.info for _, gpu in sorted(self._round.items())]

    def shutdown(self) -> None:
        self._round = {}

    def begin_round(self) -> None:
        self._round = self._fetch()

    def _gpu(self, index: int) -> SimulatedGpu:
        gpu = self._round.get(index)
        if gpu is None:
            raise GpuLostError(index, "missing from the simulated NVML response")
        return gpu

    def sample(self, index: int, slow: bool) -> GpuSample:
        source = self._gpu(index).sample
        if slow:
            return source
        # Fast reads leave the slow fields empty, exactly as the real backend does.
        return replace(source, energy_joules=None, power_limit_watts=None)

    def processes(self, index: int) -> Mapping[int, int]:
        return self._gpu(index).processes
