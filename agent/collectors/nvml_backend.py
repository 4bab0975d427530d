"""The NVML backend Protocol, its value types and its error classes.

The sampler (:mod:`agent.collectors.nvml`) talks to GPUs only through :class:`NvmlBackend`, so the same
sampler runs on real NVML (:mod:`agent.collectors.nvml_real`), on the simulator's HTTP face
(:mod:`agent.collectors.nvml_simulated`) and on the in-process fake used by tests and benchmarks
(:mod:`agent.collectors.nvml_fake`). Backends translate their own failures into three cases the sampler
knows how to handle, because that is the whole decision space:

* a field the GPU cannot report (NVML ``NotSupported``) is ``None`` in the :class:`GpuSample`;
* one GPU gone (NVML ``GpuIsLost``) raises :class:`GpuLostError`: that GPU stops, the others continue;
* the whole backend gone (no driver, library missing, simulator unreachable) raises
  :class:`NvmlUnavailableError`: the sampler marks itself down and re-initialises with backoff.

Units are converted at the backend edge (MHz -> Hz, mW -> W, mJ -> J, percent -> ratio), so everything
downstream is in base units.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

#: NVML clocks-event (formerly "clocks throttle") reason bits, from ``nvml.h``
#: (``nvmlClocksEventReason*``). These values are part of the driver ABI; a test checks them against
#: pynvml's constants. Names are the signal suffixes ``nvml.gpu<i>.throttle.<name>``.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x001, "gpu_idle"),
    (0x002, "applications_clocks_setting"),
    (0x004, "sw_power_cap"),
    (0x008, "hw_slowdown"),
    (0x010, "sync_boost"),
    (0x020, "sw_thermal_slowdown"),
    (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """Names of the known reasons set in ``mask``; unknown bits are kept in the bitmask signal only."""
    return tuple(name for bit, name in THROTTLE_REASONS if mask & bit)


class NvmlError(Exception):
    """Base class of backend errors; ``str(error)`` is one readable line."""


class NvmlUnavailableError(NvmlError):
    """The whole backend is unusable (no driver, library missing, simulator down); retry with backoff."""


class GpuLostError(NvmlError):
    """One GPU fell off the bus (NVML ``GpuIsLost``); it stays lost until the backend is re-initialised."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"gpu{index}: {message}")
        self.index = index


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """Identity of one GPU, for ``collector.gpu_info`` and the exporter's info metric."""

    index: int
    name: str
    uuid: str
    driver_version: str


@dataclass(slots=True)
class GpuSample:
    """One read of one GPU, in base units. ``None`` means the GPU cannot report that field.

    ``energy_joules`` and ``power_limit_watts`` are filled only on "slow" reads (see
    :meth:`NvmlBackend.sample`): the energy counter costs milliseconds per call on some drivers and the
    limit changes only when someone sets it, so reading them every 100 ms would waste the CPU budget.
    """

    utilization_ratio: float | None = None
    memory_bandwidth_utilization_ratio: float | None = None
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    throttle_reasons: int | None = None
    energy_joules: float | None = None
    power_limit_watts: float | None = None


class NvmlBackend(Protocol):
    """A source of GPU samples. All methods are called from the sampler thread only."""

    #: ``"nvml"``, ``"simulated"`` or ``"fake"``; reported in the Reading's info.
    kind: str

    def init(self) -> list[GpuInfo]:
        """Open the backend and list every GPU it sees. Raises :class:`NvmlUnavailableError`."""
        ...

    def shutdown(self) -> None:
        """Release the backend (``nvmlShutdown``). Never raises; safe to call when not initialised."""
        ...

    def begin_round(self) -> None:
        """Start one sampling round over all GPUs (the simulated backend fetches its JSON here, once).

        Raises :class:`NvmlUnavailableError`.
        """
        ...

    def sample(self, index: int, slow: bool) -> GpuSample:
        """Read GPU ``index``; with ``slow`` also the energy counter and power limit.

        Raises :class:`GpuLostError` or :class:`NvmlUnavailableError`; an unsupported field is ``None``.
        """
        ...

    def processes(self, index: int) -> Mapping[int, int]:
        """Used GPU memory in bytes per PID (compute and graphics processes) on GPU ``index``.

        Takes the driver's global lock on real NVML, so the sampler calls it at most once per
        ``nvml.process_interval_s``. Raises like :meth:`sample`; unsupported means an empty mapping.
        """
        ...
