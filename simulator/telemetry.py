"""What NVML and the allocator probe would report about the simulated engine.

Memory follows vLLM: the caching allocator holds the weights, the whole KV pool (allocated once at
start-up) and the activations of the step in flight; ``reserved`` stays at the peak of the profiling pass.
A leak fault adds to allocated, reserved and process memory; a fragmentation fault adds reserved-but-free
memory until ``1 - allocated / reserved`` reaches its ratio. NVML's utilisations are busy shares over the
last window (as the driver's sampling does), power is the window's mean (energy difference / time).

A node may have more GPUs than the engine uses (``node_gpus``): the engine runs on the last ``tp`` of
them and the others idle, as on a node shared with other pods. The probe then names the engine's GPUs by
UUID (device 0 is the first of them), which is how the sidecar tells its engine's GPUs from the rest.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from simulator.engine import EngineCore
from simulator.kvcache import activation_reserve_bytes
from simulator.power import REASON_GPU_IDLE

MIB = 1024**2
#: CUDA context, cuBLAS/NCCL workspaces and other memory NVML sees but torch does not.
NON_TORCH_BYTES = 600 * MIB
ALLOCATOR_SLACK_BYTES = 64 * MIB
DRIVER_VERSION = "550.54.15"


def _ratio(value: float) -> float:
    return min(1.0, max(0.0, value))


@dataclass(frozen=True)
class MemoryState:
    """Per-GPU allocator and process memory, in bytes."""

    allocated: float
    reserved: float
    active: float
    inactive_split: float
    peak_allocated: float
    process: float
    total: float

    @property
    def fragmentation_ratio(self) -> float:
        return 1.0 - self.allocated / self.reserved if self.reserved > 0 else 0.0


def memory_state(core: EngineCore, now: float) -> MemoryState:
    """The memory picture of one GPU at ``now`` (pure: depends only on the core's state)."""
    budget = core.budget
    leaked = core.leaked_bytes(now)
    resident = budget.weight_bytes + budget.kv_pool_bytes + leaked
    allocated = resident + core.gpu_counters.activation_bytes
    peak_activation = activation_reserve_bytes(core.model, core.max_num_batched_tokens, core.gpu.tp)
    peak_allocated = resident + peak_activation
    reserved = peak_allocated + ALLOCATOR_SLACK_BYTES
    frag = core.faults.fragmentation_ratio
    if frag > 0:
        reserved = max(reserved, allocated / (1.0 - frag))
    free_in_pool = reserved - allocated
    inactive = free_in_pool * (0.8 if frag > 0 else 0.05)
    process = min(reserved + NON_TORCH_BYTES, float(core.gpu.memory_bytes))
    return MemoryState(
        allocated, reserved, allocated, inactive, peak_allocated, process, float(core.gpu.memory_bytes)
    )


class NvmlView:
    """Builds the ``/sim/nvml`` JSON. Keeps a short history of the core's counters to compute window
    ratios; ``window_s`` is in simulated seconds."""

    def __init__(
        self,
        core: EngineCore,
        *,
        seed: int = 0,
        pid: int = 4242,
        window_s: float = 1.0,
        node_gpus: int | None = None,
    ) -> None:
        count = core.gpu.tp if node_gpus is None else node_gpus
        if count < core.gpu.tp:
            raise ValueError(
                f"node_gpus ({count}) must be at least the engine's tensor-parallel size ({core.gpu.tp})"
            )
        self.core = core
        self.pid = pid
        self.window_s = window_s
        self._start = core.time
        # Stable per seed and index, so a restarted simulator looks like the same node.
        self._uuids = [
            "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"servepilot-sim/{seed}/{i}")) for i in range(count)
        ]
        #: node indices of the GPUs the engine runs on: the last ``tp``
        self.engine_indices = range(count - core.gpu.tp, count)
        g = core.gpu_counters
        self._history: deque[tuple[float, float, float, float]] = deque(
            [(core.time, g.busy_s, g.mem_busy_s, g.energy_j)]
        )

    def _window(self, now: float) -> tuple[float, float, float]:
        """(busy share, memory-busy share, mean power) over about the last ``window_s``."""
        core = self.core
        core.idle_until(now)
        g = core.gpu_counters
        t = max(now, core.time)
        current = (t, g.busy_s, g.mem_busy_s, g.energy_j)
        history = self._history
        while len(history) > 1 and history[1][0] <= t - self.window_s:
            history.popleft()
        t0, busy0, mem0, energy0 = history[0]
        history.append(current)
        span = t - t0
        if span <= 0:
            return 0.0, 0.0, g.power_w
        return (
            _ratio((g.busy_s - busy0) / span),
            _ratio((g.mem_busy_s - mem0) / span),
            (g.energy_j - energy0) / span,
        )

    def read(self, now: float) -> dict[str, Any]:
        """The JSON document, one entry per GPU of the node (tensor-parallel ranks are symmetric)."""
        core = self.core
        util, mem_util, power = self._window(now)
        g = core.gpu_counters
        idle = util < 0.01
        reasons = REASON_GPU_IDLE if idle else g.throttle_reasons
        memory = memory_state(core, now)
        gpus = []
        for index, gpu_uuid in enumerate(self._uuids):
            if index not in self.engine_indices:
                gpus.append(self._neighbour(index, gpu_uuid, now))
                continue
            gpus.append(
                {
                    "index": index,
                    "name": core.gpu.name,
                    "uuid": gpu_uuid,
                    "utilization_gpu_ratio": util,
                    "utilization_memory_ratio": mem_util,
                    "sm_clock_mhz": float(core.gpu.clock_min_mhz if idle else g.clock_mhz),
                    "mem_clock_mhz": float(core.gpu.mem_clock_mhz),
                    "temperature_c": round(core.thermal.temperature_c, 2),
                    "power_w": power,
                    "power_limit_w": float(core.settings.power_limit_w),
                    "energy_j": g.energy_j,
                    "memory_used_bytes": int(memory.process),
                    "memory_total_bytes": int(memory.total),
                    "throttle_reasons": reasons,
                    "processes": [{"pid": self.pid + index, "used_memory_bytes": int(memory.process)}],
                }
            )
        return {"driver_version": DRIVER_VERSION, "gpus": gpus}

    @property
    def engine_uuids(self) -> list[str]:
        """The engine's GPUs, as its probe names them: CUDA device ``d`` is ``engine_uuids[d]``."""
        return [self._uuids[i] for i in self.engine_indices]

    def _neighbour(self, index: int, gpu_uuid: str, now: float) -> dict[str, Any]:
        """A GPU of the node the engine does not use: idle at its lowest clock, no process of ours."""
        gpu = self.core.gpu
        return {
            "index": index,
            "name": gpu.name,
            "uuid": gpu_uuid,
            "utilization_gpu_ratio": 0.0,
            "utilization_memory_ratio": 0.0,
            "sm_clock_mhz": float(gpu.clock_min_mhz),
            "mem_clock_mhz": float(gpu.mem_clock_mhz),
            "temperature_c": round(gpu.ambient_c + gpu.thermal_resistance_c_per_w * gpu.idle_power_w, 2),
            "power_w": gpu.idle_power_w,
            "power_limit_w": float(gpu.tdp_w),
            "energy_j": gpu.idle_power_w * max(0.0, now - self._start),
            "memory_used_bytes": 0,
            "memory_total_bytes": int(gpu.memory_bytes),
            "throttle_reasons": REASON_GPU_IDLE,
            "processes": [],
        }
