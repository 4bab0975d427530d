"""The GPU actuator: one knob, either a power limit (W) or a locked SM clock ceiling (MHz), on every GPU.

Safety, in order of what can go wrong:

* **Permission.** NVML's set calls need root or ``CAP_SYS_ADMIN``. The check runs at construction; when it
  fails, ``servepilot_actuator_permitted{actuator}`` is 0, ``set`` raises one clear line, and nothing
  else breaks (observe/advise modes keep working).
* **Which GPUs.** ``actuators.gpus``, each of which the container must see (else a config error at
  start); when it names none, every GPU the container sees, with a warning when that is more than one: a
  sidecar on a node shared by several pods may see its neighbours' GPUs.
* **Bounds.** Values are clamped to what the GPU reports (``min(max, max(min, value))``).
* **The agent stops renewing.** Every ``set``/``renew`` extends a lease of ``lease_s``; a watchdog thread
  (independent of the event loop, so a wedged loop still counts as "stopped") restores the defaults
  when it lapses.
* **SIGTERM.** ``close()`` restores the defaults; the sidecar calls it on shutdown, and
  :meth:`install_signal_restore` covers processes that do not.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from prometheus_client import CollectorRegistry, Gauge

from agent.actuators.gpu_backend import (
    GpuBackend,
    GpuControlError,
    NvmlGpuBackend,
    SimulatedGpuBackend,
    permission_problem,
)
from agent.config import ActuatorConfig, ConfigError

log = logging.getLogger(__name__)


def describe_gpus(indices: list[int]) -> str:
    """``GPU 3``, ``GPUs 0, 1`` or ``no GPU``: indices as a message names them."""
    if not indices:
        return "no GPU"
    return ("GPU " if len(indices) == 1 else "GPUs ") + ", ".join(map(str, indices))


def backend_for(cfg: ActuatorConfig) -> GpuBackend:
    """The backend ``cfg.gpu_backend`` names; GpuControlError when real NVML cannot start."""
    if cfg.gpu_backend == "simulated":
        try:
            return SimulatedGpuBackend(state_file=cfg.gpu_state_file)
        except (OSError, ValueError, KeyError, TypeError) as error:  # no such directory, not JSON, not ours
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            raise ConfigError(
                "actuators.gpu_state_file",
                f"{cfg.gpu_state_file!r} cannot be used as the simulated GPU state: {reason}",
            ) from None
    return NvmlGpuBackend()


class GpuActuator:
    """Drives ``cfg.gpu`` (``power_limit`` or ``locked_clocks``) on ``cfg.gpus`` (empty = all)."""

    def __init__(
        self,
        cfg: ActuatorConfig,
        backend: GpuBackend,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
        permission: Callable[[], str | None] = permission_problem,
        watchdog: bool = True,
    ) -> None:
        if cfg.gpu == "off":
            raise ValueError("actuators.gpu is off: there is no GPU knob to drive")
        self.kind = cfg.gpu
        self.knob = "gpu_power_limit_w" if cfg.gpu == "power_limit" else "gpu_max_clock_mhz"
        self.backend = backend
        self.clock = clock
        self.lease_s = cfg.gpu_lease_s
        visible = backend.gpu_indices()
        unknown = [index for index in cfg.gpus if index not in visible]
        if unknown:
            named, seen = describe_gpus(unknown), describe_gpus(visible)
            raise ConfigError("actuators.gpus", f"names {named}, but this container sees {seen}")
        self.indices = list(cfg.gpus) or visible
        #: No GPU named and several visible: every one is driven. On a node shared by several pods, a
        #: sidecar given ``NVIDIA_VISIBLE_DEVICES=all`` (docs/deploy.md) sees its neighbours' GPUs too.
        self.drives_every_visible_gpu = not cfg.gpus and len(visible) > 1
        if self.drives_every_visible_gpu:
            log.warning(
                "GPU actuator: actuators.gpus is empty, so it drives all the GPUs this container sees (%s); "
                "on a node shared with other pods, name the engine's GPUs in actuators.gpus",
                describe_gpus(visible),
            )
        self.problem = permission()
        self._changed = False
        self._lease_until = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        gauge = Gauge(
            "servepilot_actuator_permitted", "1 when the actuator may act.", ["actuator"], registry=registry
        )
        gauge.labels(self.knob).set(0.0 if self.problem else 1.0)
        if self.problem:
            log.error("GPU actuator cannot act: %s", self.problem)
        self._thread: threading.Thread | None = None
        if watchdog:
            self._thread = threading.Thread(target=self._watch, name="servepilot-gpu-lease", daemon=True)
            self._thread.start()

    @property
    def permitted(self) -> bool:
        return self.problem is None

    def bounds(self) -> tuple[float, float]:
        index = self.indices[0]
        if self.kind == "power_limit":
            return self.backend.power_limit_bounds_w(index)
        return self.backend.clock_bounds_mhz(index)

    def top(self) -> float:
        """The knob at full speed: the highest clock, or the default power limit (not the maximum one may
        set: a limit above the default is no setting the GPU returns to when servepilot lets go)."""
        lo, hi = self.bounds()
        if self.kind == "power_limit":
            return max(lo, min(hi, self.backend.default_power_limit_w(self.indices[0])))
        return hi

    def current(self) -> float | None:
        """The knob's value on the first GPU (None: clocks not locked)."""
        index = self.indices[0]
        if self.kind == "power_limit":
            return self.backend.power_limit_w(index)
        return self.backend.locked_max_clock_mhz(index)

    def set(self, value: float) -> float:
        """Set the knob (absolute) on every GPU, clamped to its bounds; returns the value applied."""
        if self.problem:
            raise GpuControlError(self.problem)
        with self._lock:
            lo, hi = self.bounds()
            applied = min(hi, max(lo, float(value)))
            for index in self.indices:
                if self.kind == "power_limit":
                    self.backend.set_power_limit_w(index, applied)
                else:
                    self.backend.lock_clocks_mhz(index, self.backend.clock_bounds_mhz(index)[0], applied)
            self._changed = True
            self._lease_until = self.clock() + self.lease_s
        return applied

    def renew(self) -> None:
        """The agent is alive and still wants its setting: extend the lease."""
        with self._lock:
            self._lease_until = self.clock() + self.lease_s

    def check(self) -> bool:
        """Restore the defaults if the lease lapsed; True when it restored now. The watchdog calls it."""
        with self._lock:
            lapsed = self._changed and self.clock() >= self._lease_until
        if lapsed:
            log.warning("GPU lease lapsed (no renewal for %g s): restoring defaults", self.lease_s)
            self.restore()
        return lapsed

    def restore(self) -> bool:
        """Put every driven GPU back to its default power limit / unlocked clocks; True when there was
        something to put back. Never raises."""
        with self._lock:
            if not self._changed:
                return False
            for index in self.indices:
                try:
                    if self.kind == "power_limit":
                        self.backend.set_power_limit_w(index, self.backend.default_power_limit_w(index))
                    else:
                        self.backend.reset_clocks(index)
                except GpuControlError as error:
                    log.error("restoring gpu%d failed: %s", index, error)
            self._changed = False
            return True

    def _watch(self) -> None:
        period = max(0.05, min(1.0, self.lease_s / 4))
        while not self._stop.wait(period):
            self.check()

    def close(self) -> None:
        """Stop the watchdog and restore the defaults (the sidecar's shutdown path, e.g. on SIGTERM)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self.restore()

    def install_signal_restore(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """For processes that do not route SIGTERM to a clean shutdown: restore, then the old handler."""
        for sig in signals:
            previous = signal.getsignal(sig)

            def handler(signum: int, frame: FrameType | None, previous: object = previous) -> None:
                self.close()
                if callable(previous):
                    previous(signum, frame)
                else:
                    raise SystemExit(128 + signum)

            signal.signal(sig, handler)
