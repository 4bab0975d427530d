"""The GPU actuator: one knob, either a power limit (W) or a locked SM clock ceiling (MHz), on every GPU.

Safety, in order of what can go wrong:

* **Permission.** NVML's set calls need root or ``CAP_SYS_ADMIN``. The check runs at construction; when it
  fails, ``servepilot_actuator_permitted{actuator}`` is 0, ``set`` raises one clear line, and nothing
  else breaks (observe/advise modes keep working).
* **Which GPUs.** ``actuators.gpus``, each of which the container must see (else a config error at
  start). When it names none and the container sees one GPU, that one. When it sees several (a sidecar
  on a node shared by several pods may see its neighbours' GPUs): with the allocator probe on, the
  engine's GPUs as the probe names them by UUID (:mod:`agent.engine_gpus`), and nothing is set until it
  has (a probe too old to name them: every GPU, with a warning); without the probe, every GPU, with a
  warning. GPUs it stops driving get their defaults back.
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
from collections.abc import Callable, Sequence
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
from agent.engine_gpus import indices_of

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
        follow_engine: bool = False,
    ) -> None:
        """``follow_engine``: the allocator probe is on, so :meth:`follow` will name the engine's GPUs."""
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
        self.named = bool(cfg.gpus)
        #: Why nothing is set yet (None: it may be): several GPUs visible, none named, and the probe is to
        #: say which are the engine's. On a node shared by several pods, a sidecar given
        #: ``NVIDIA_VISIBLE_DEVICES=all`` (docs/deploy.md) sees its neighbours' GPUs too.
        self.waiting: str | None = None
        #: No GPU named, several visible, no probe to tell: every one is driven.
        self.drives_every_visible_gpu = not cfg.gpus and len(visible) > 1
        if self.drives_every_visible_gpu and follow_engine:
            self.drives_every_visible_gpu = False
            self.waiting = (
                "waiting for the allocator probe to name the engine's GPUs among the "
                f"{describe_gpus(visible)} this container sees (or name them in actuators.gpus)"
            )
            log.info("GPU actuator: %s", self.waiting)
        elif self.drives_every_visible_gpu:
            log.warning(
                "GPU actuator: actuators.gpus is empty, so it drives all the GPUs this container sees (%s); "
                "on a node shared with other pods, name the engine's GPUs in actuators.gpus",
                describe_gpus(visible),
            )
        self._applied: float | None = None
        self.problem = permission()
        self._changed = False
        self._lease_until = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        gauge = Gauge(
            "servepilot_actuator_permitted", "1 when the actuator may act.", ["actuator"], registry=registry
        )
        gauge.labels(self.knob).set(0.0 if self.problem else 1.0)
        Gauge(
            "servepilot_actuator_waiting",
            "1 while the actuator sets nothing because it does not know the engine's GPUs yet (the probe has "
            "not named them, or none of them is seen here).",
            ["actuator"],
            registry=registry,
        ).labels(self.knob).set_function(lambda: float(self.waiting is not None))
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
        """The knob's value on the first GPU driven (None: clocks not locked, or no GPU driven yet: while
        the actuator waits, the first GPU seen may be a neighbour's, and its setting is not this engine's)."""
        if self.waiting:
            return None
        index = self.indices[0]
        if self.kind == "power_limit":
            return self.backend.power_limit_w(index)
        return self.backend.locked_max_clock_mhz(index)

    def set(self, value: float) -> float:
        """Set the knob (absolute) on every GPU, clamped to its bounds; returns the value applied."""
        if self.problem:
            raise GpuControlError(self.problem)
        if self.waiting:
            raise GpuControlError(self.waiting)
        with self._lock:
            lo, hi = self.bounds()
            applied = min(hi, max(lo, float(value)))
            for index in self.indices:
                self._apply(index, applied)
            self._changed = True
            self._applied = applied
            self._lease_until = self.clock() + self.lease_s
        return applied

    def _apply(self, index: int, value: float) -> None:
        if self.kind == "power_limit":
            self.backend.set_power_limit_w(index, value)
        else:
            self.backend.lock_clocks_mhz(index, self.backend.clock_bounds_mhz(index)[0], value)

    def follow(self, uuids: Sequence[str] | None) -> None:
        """Drive the engine's GPUs, as the probe names them by UUID (agent/engine_gpus.py).

        Nothing changes when ``actuators.gpus`` names GPUs. ``None`` (the probe answers but cannot name
        them) ends the wait on every visible GPU, with a warning. A GPU no longer driven gets its default
        back; one newly driven gets the setting in force. When this container sees none of the engine's
        GPUs, nothing is set, and the reason says so.
        """
        if self.named:
            return
        visible = self.backend.gpu_indices()
        if uuids is None:
            self._drive_all_seen(visible, "the allocator probe does not name the engine's GPUs (a probe "
                                 "from an older servepilot?)")  # fmt: skip
            return
        try:
            known = {index: self.backend.gpu_uuid(index) for index in visible}
        except GpuControlError as error:
            log.error("GPU actuator: cannot read the GPUs' UUIDs to find the engine's: %s", error)
            return
        if not any(known.values()):
            # GPUs with no identity (a simulated backend without UUIDs) cannot be matched to the probe's:
            # that says nothing about whose they are, so it is a probe that cannot name them, not a miss
            self._drive_all_seen(visible, "the GPUs this container sees have no UUID to match the engine's")
            return
        indices, missing = indices_of(uuids, known)
        if not indices:
            self.waiting = (
                f"the engine's GPUs ({', '.join(uuids)}) are not among the {describe_gpus(visible)} this "
                "container sees: give the sidecar the engine's GPUs, or name them in actuators.gpus (on MIG "
                "the probe names instances, not GPUs; docs/deploy.md)"
            )
            log.error("GPU actuator: %s", self.waiting)
            self._retarget([])
            return
        if missing:
            log.warning(
                "GPU actuator: the engine's GPU(s) %s not seen here; driving the others", ", ".join(missing)
            )
        self.waiting, self.drives_every_visible_gpu = None, False
        if indices != self.indices:
            log.info("GPU actuator: drives the engine's %s (named by the probe)", describe_gpus(indices))
            self._retarget(indices)

    def _drive_all_seen(self, visible: list[int], why: str) -> None:
        """End a wait the probe cannot end by naming GPUs: drive every GPU seen, and say why."""
        if self.waiting:
            log.warning(
                "GPU actuator: %s, so it drives all the GPUs this container sees (%s); on a node shared "
                "with other pods, name the engine's GPUs in actuators.gpus",
                why,
                describe_gpus(visible),
            )
            self.waiting, self.drives_every_visible_gpu = None, len(visible) > 1

    def _retarget(self, indices: list[int]) -> None:
        """Drive ``indices`` from now on: the dropped GPUs get their defaults back, the added ones the
        setting in force. ``[]`` keeps the old list for :meth:`bounds` but puts every GPU back."""
        with self._lock:
            dropped = [i for i in self.indices if i not in indices]
            added = [i for i in indices if i not in self.indices]
            if self._changed:
                self._restore(dropped)
                if self._applied is not None:
                    for index in added:
                        try:
                            self._apply(index, self._applied)
                        except GpuControlError as error:
                            log.error("setting gpu%d failed: %s", index, error)
            if indices:
                self.indices = indices
            else:
                self._changed = False

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
            self._restore(self.indices)
            self._changed = False
            return True

    def _restore(self, indices: list[int]) -> None:
        for index in indices:
            try:
                if self.kind == "power_limit":
                    self.backend.set_power_limit_w(index, self.backend.default_power_limit_w(index))
                else:
                    self.backend.reset_clocks(index)
            except GpuControlError as error:
                log.error("restoring gpu%d failed: %s", index, error)

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
