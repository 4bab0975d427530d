"""Allocator statistics: where they come from and how one device's raw stats become probe values.

The probe reads PyTorch's caching-allocator counters (``torch.cuda.memory_stats(device)``), a flat dict
such as ``{"allocated_bytes.all.current": ..., "num_ooms": ...}``. NVML only sees what the allocator has
*reserved* from the driver; these counters also say how much of it live tensors really use, which is what
separates "the KV cache is full" from "the allocator is fragmented" (``1 - allocated / reserved``).

A :data:`StatsSource` is any callable returning ``{device_index: memory_stats_dict}``, or ``None`` when
CUDA is not in use in this process. Tests inject one; :func:`torch_stats` is the real one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

#: ``() -> {device: torch.cuda.memory_stats(device)}``, or ``None`` when CUDA is not used here.
StatsSource = Callable[[], Mapping[int, Mapping[str, Any]] | None]
#: ``(devices) -> {device: UUID}``: which physical GPU each CUDA device index of this process is.
UuidSource = Callable[[Iterable[int]], Mapping[int, str]]


@dataclass(frozen=True)
class DeviceStats:
    """The allocator figures the probe serves for one CUDA device (bytes, counts; all finite)."""

    device: int
    allocated_bytes: float
    reserved_bytes: float
    active_bytes: float
    inactive_split_bytes: float
    peak_allocated_bytes: float
    peak_reserved_bytes: float
    alloc_retries: float
    ooms: float

    @property
    def fragmentation_ratio(self) -> float:
        """``1 - allocated / reserved``: the share of reserved memory no live tensor uses (0 if none)."""
        return fragmentation(self.allocated_bytes, self.reserved_bytes)


def fragmentation(allocated: float, reserved: float) -> float:
    """``1 - allocated / reserved`` clamped to [0, 1]; 0 when nothing is reserved."""
    if reserved <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - allocated / reserved))


def _number(stats: Mapping[str, Any], key: str) -> float:
    """A counter from ``memory_stats``; missing or odd values count as 0 so one bad key loses no other."""
    try:
        value = float(stats.get(key, 0) or 0)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value >= 0 else 0.0


def device_stats(device: int, stats: Mapping[str, Any]) -> DeviceStats:
    """Convert one ``torch.cuda.memory_stats()`` dict into :class:`DeviceStats`."""
    return DeviceStats(
        device=device,
        allocated_bytes=_number(stats, "allocated_bytes.all.current"),
        reserved_bytes=_number(stats, "reserved_bytes.all.current"),
        active_bytes=_number(stats, "active_bytes.all.current"),
        inactive_split_bytes=_number(stats, "inactive_split_bytes.all.current"),
        peak_allocated_bytes=_number(stats, "allocated_bytes.all.peak"),
        peak_reserved_bytes=_number(stats, "reserved_bytes.all.peak"),
        alloc_retries=_number(stats, "num_alloc_retries"),
        ooms=_number(stats, "num_ooms"),
    )


def cuda_in_use() -> bool:
    """True when PyTorch has already initialised CUDA in this process.

    Deliberately *not* ``torch.cuda.is_available()``: that call initialises the CUDA driver, and a process
    that later forks (vLLM's API server starting its engine) would hand its children a poisoned CUDA
    state. A process that has not initialised CUDA holds no allocator memory, so there is nothing to
    report anyway. Torch is imported only if the engine already imported it.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def torch_stats() -> dict[int, dict[str, Any]] | None:
    """The real source: ``memory_stats`` of every device this process has used, or ``None``.

    A device counts as used when it is the current device or the allocator ever reserved memory on it;
    with tensor parallelism every worker sees all GPUs but uses one, and reporting the others as zeros
    would only add noise.
    """
    if not cuda_in_use():
        return None
    import torch  # lazy: already loaded by the engine when cuda_in_use() is true

    current = torch.cuda.current_device()
    result: dict[int, dict[str, Any]] = {}
    for index in range(torch.cuda.device_count()):
        stats = dict(torch.cuda.memory_stats(index))
        if index == current or _number(stats, "reserved_bytes.all.peak") > 0:
            result[index] = stats
    return result


def nvml_style_uuid(raw: str) -> str:
    """A device UUID as NVML and ``nvidia-smi -L`` write it (``GPU-8f1c…``), whatever form torch gave.

    torch prints a CUDA device's UUID as bare hex (``8f1c…``); NVML prefixes ``GPU-`` (or ``MIG-`` for a
    MIG instance). The sidecar matches the engine's GPUs to its own NVML view by this string.
    """
    text = raw.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            return prefix.upper() + text[len(prefix) :]
    return "GPU-" + text


_uuid_cache: dict[int, str] = {}


def torch_device_uuids(devices: Iterable[int]) -> dict[int, str]:
    """The real :data:`UuidSource`: ``torch.cuda.get_device_properties(d).uuid`` for each device.

    CUDA device indices are this process's (after ``CUDA_VISIBLE_DEVICES``), not the node's, so the index
    alone cannot tell the sidecar which GPU the engine runs on; the UUID can. A device whose properties
    cannot be read (an old torch, a ROCm build without UUIDs) is left out. UUIDs never change while the
    process lives, so each is read once.
    """
    if not cuda_in_use():
        return {}
    import torch  # lazy: already loaded by the engine when cuda_in_use() is true

    found: dict[int, str] = {}
    for device in devices:
        if device not in _uuid_cache:
            try:
                raw = str(torch.cuda.get_device_properties(device).uuid)
            except Exception:
                continue
            if not raw.strip():
                continue
            _uuid_cache[device] = nvml_style_uuid(raw)
        found[device] = _uuid_cache[device]
    return found


def torch_version() -> str:
    """The torch version, without importing torch (installed metadata; ``"none"`` when not installed)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(getattr(torch, "__version__", "unknown"))
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"
