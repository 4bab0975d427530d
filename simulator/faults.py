"""Fault switches: the failure modes servepilot must detect, injected on purpose.

HTTP-level faults (slow ``/metrics``, a share of 5xx answers) and a hung engine are applied by the
server; engine-level faults (memory leak, fragmentation, latency spike, hot room) live in the core's
simulated time, so a replay sees them at the same simulated moments as the live server does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MIB = 1024**2

#: field -> (lower, upper) inclusive bounds.
_BOUNDS: dict[str, tuple[float, float]] = {
    "metrics_delay_s": (0.0, 600.0),
    "error_rate": (0.0, 1.0),
    "leak_bytes_per_hour": (0.0, 1e13),
    "leak_step_bytes": (1.0, 1e12),
    "fragmentation_ratio": (0.0, 0.9),
    "latency_factor": (1.0, 100.0),
    "ambient_c": (-20.0, 80.0),
    "spec_acceptance": (0.0, 1.0),
}
ERROR_STATUSES = (500, 503)


STALLED_GPU = ("busy", "idle")
"""What a stalled engine's GPUs read: a collective spinning, or nothing launched."""


class FaultError(ValueError):
    """A fault switch with a bad value; the message names the field and its range."""


@dataclass(frozen=True)
class FaultSwitches:
    """Current faults; the defaults are "no fault".

    ``leak_bytes_per_hour`` grows allocated, reserved and process memory in stairs of
    ``leak_step_bytes`` (a leak that keeps tensors alive); ``fragmentation_ratio`` adds reserved-but-free
    memory so that ``1 - allocated / reserved`` rises to it; ``latency_factor`` multiplies every step;
    ``ambient_c`` overrides the inlet temperature (a cooling failure, to provoke thermal slowdown);
    ``stalled`` hangs the engine: requests are taken and held, no step runs, while ``/health``,
    ``/metrics`` and the control API answer as before (a collective that never returns, a stuck kernel).
    The live server honours it; a replay does not (its workload loop would never end). ``stalled_gpu``
    is what the simulated NVML reads meanwhile: ``busy`` (the default: a collective's spin kernels keep
    the GPU busy at its top clock, near idle power, as a real NCCL hang reads) or ``idle`` (the host
    side is stuck and launches nothing). ``spec_acceptance`` overrides a drafting engine's per-token
    acceptance (traffic its drafts no longer predict: sampling, another language); ``null`` restores
    the configured one.
    """

    metrics_delay_s: float = 0.0
    error_rate: float = 0.0
    error_status: int = 503
    leak_bytes_per_hour: float = 0.0
    leak_step_bytes: float = 256 * MIB
    fragmentation_ratio: float = 0.0
    latency_factor: float = 1.0
    ambient_c: float | None = None
    stalled: bool = False
    stalled_gpu: str = "busy"
    spec_acceptance: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, changes: Mapping[str, Any]) -> FaultSwitches:
        """A copy with ``changes`` applied; unknown fields and out-of-range values raise FaultError."""
        if not isinstance(changes, Mapping):
            raise FaultError("faults must be a JSON object")
        known = {f.name for f in dataclasses.fields(self)}
        values: dict[str, Any] = {}
        for name, raw in changes.items():
            if name not in known:
                raise FaultError(f"{name} is not a fault switch; known: {', '.join(sorted(known))}")
            values[name] = _check(name, raw)
        return dataclasses.replace(self, **values)


def _check(name: str, raw: Any) -> Any:
    if name in ("ambient_c", "spec_acceptance") and raw is None:
        return None
    if name == "stalled":
        if not isinstance(raw, bool):
            raise FaultError(f"stalled must be true or false, got {raw!r}")
        return raw
    if name == "stalled_gpu":
        if raw not in STALLED_GPU:
            raise FaultError(f"stalled_gpu must be one of {list(STALLED_GPU)}, got {raw!r}")
        return raw
    if name == "error_status":
        if raw not in ERROR_STATUSES or isinstance(raw, bool):
            raise FaultError(f"error_status must be one of {list(ERROR_STATUSES)}, got {raw!r}")
        return int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise FaultError(f"{name} must be a finite number, got {raw!r}")
    lo, hi = _BOUNDS[name]
    if not lo <= raw <= hi:
        raise FaultError(f"{name} must be in [{lo:g}, {hi:g}], got {raw!r}")
    return float(raw)
