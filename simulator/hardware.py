"""GPU profiles: the datasheet numbers the roofline, power and thermal models are built on.

Figures are NVIDIA datasheet values (dense, no sparsity) for the SXM parts; the power split (idle, dynamic
core, memory) and thermal constants are first-order fits chosen so that a compute-bound step at full clock
lands near TDP and a memory-bound decode step near 60-70 % of it, which is what nvidia-smi shows on real
servers. A tensor-parallel node is one profile with ``tp`` > 1: bandwidth and FLOPs are per GPU and the
step-time model divides the work across ranks and adds the all-reduce cost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

GIB = 1024**3
GB = 1e9
TB = 1e12
TFLOPS = 1e12

#: Precisions the simulator knows. bf16 runs at the fp16 rate; fp8 is W8A8 with an fp8 KV cache.
PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp8")


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model (per-GPU figures) and the node shape it is used in.

    ``peak_flops`` maps precision to dense tensor-core FLOP/s; a precision missing from it (fp8 on Ampere)
    runs weight-only: its bytes shrink but its math runs at the fp16 rate (vLLM's Marlin kernels).
    """

    key: str
    name: str
    memory_bytes: int
    bandwidth_bps: float
    peak_flops: Mapping[str, float]
    tdp_w: float
    min_power_limit_w: float
    clock_min_mhz: float
    clock_max_mhz: float
    mem_clock_mhz: float
    idle_power_w: float
    core_dynamic_w: float
    memory_dynamic_w: float
    ambient_c: float = 30.0
    thermal_resistance_c_per_w: float = 0.075
    thermal_time_constant_s: float = 45.0
    slowdown_temp_c: float = 87.0
    shutdown_temp_c: float = 95.0
    tp: int = 1
    link_bandwidth_bps: float = 0.0
    link_latency_s: float = 0.0
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def flops(self, precision: str) -> float:
        """Dense FLOP/s per GPU for ``precision``; weight-only precisions fall back to the fp16 rate."""
        return self.peak_flops.get(precision, self.peak_flops["fp16"])

    def supports_native(self, precision: str) -> bool:
        """True when the tensor cores run ``precision`` natively (fp8 on Hopper, not on Ampere)."""
        return precision in self.peak_flops


_A100 = dict(
    name="NVIDIA A100-SXM4-80GB",
    memory_bytes=80 * GIB,
    bandwidth_bps=2.039 * TB,
    peak_flops={"fp16": 312 * TFLOPS, "bf16": 312 * TFLOPS},
    tdp_w=400.0,
    min_power_limit_w=100.0,
    clock_min_mhz=210.0,
    clock_max_mhz=1410.0,
    mem_clock_mhz=1593.0,
    idle_power_w=55.0,
    core_dynamic_w=300.0,
    memory_dynamic_w=85.0,
    thermal_resistance_c_per_w=0.13,
)

GPUS: Mapping[str, GpuProfile] = MappingProxyType(
    {
        "a100-80g": GpuProfile(key="a100-80g", **_A100),  # type: ignore[arg-type]
        "h100-sxm": GpuProfile(
            key="h100-sxm",
            name="NVIDIA H100 80GB HBM3",
            memory_bytes=80 * GIB,
            bandwidth_bps=3.35 * TB,
            peak_flops={"fp16": 989 * TFLOPS, "bf16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
            tdp_w=700.0,
            min_power_limit_w=200.0,
            clock_min_mhz=345.0,
            clock_max_mhz=1980.0,
            mem_clock_mhz=2619.0,
            idle_power_w=70.0,
            core_dynamic_w=520.0,
            memory_dynamic_w=130.0,
        ),
        "h200": GpuProfile(
            key="h200",
            name="NVIDIA H200",
            memory_bytes=141_000_000_000,
            bandwidth_bps=4.8 * TB,
            peak_flops={"fp16": 989 * TFLOPS, "bf16": 989 * TFLOPS, "fp8": 1979 * TFLOPS},
            tdp_w=700.0,
            min_power_limit_w=200.0,
            clock_min_mhz=345.0,
            clock_max_mhz=1980.0,
            mem_clock_mhz=3201.0,
            idle_power_w=75.0,
            core_dynamic_w=500.0,
            memory_dynamic_w=160.0,
        ),
        # Four A100s on NVLink 3 (300 GB/s each way per GPU) running one tensor-parallel engine.
        "4xa100-80g-tp": GpuProfile(
            key="4xa100-80g-tp",
            tp=4,
            link_bandwidth_bps=300 * GB,
            link_latency_s=8e-6,
            **_A100,  # type: ignore[arg-type]
        ),
    }
)


def gpu_profile(key: str) -> GpuProfile:
    """Look a profile up by key, case-insensitively; unknown keys raise with the known ones listed."""
    try:
        return GPUS[key.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {key!r}; known: {', '.join(GPUS)}") from None
