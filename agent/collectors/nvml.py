"""GPU telemetry: a sampler thread reads NVML every ``nvml.sample_interval_s``; each tick drains it.

NVML values move faster than the control loop ticks (a 100 ms power spike vanishes in a 1 s tick), so a
thread samples at 10 Hz into per-GPU running sums and the collector turns them into mean / max / last once
per tick (aggregation and signal names: :mod:`agent.collectors.nvml_aggregate`). Running sums keep the
sampler cheap: one :class:`GpuSample` per GPU per round and a few float additions, no per-sample lists.

Slow reads (energy counter, power limit: ``nvml.energy_interval_s``) and per-process memory (takes the
driver's global lock: ``nvml.process_interval_s`` >= 1 s) happen at most that often and are reported as
their latest value every tick.

Failure handling (see :mod:`agent.collectors.nvml_backend`): backend unavailable -> ``up`` False, one
warning per outage, re-init with jittered exponential backoff; a lost GPU stops alone (when every watched
GPU is lost, the backend is re-initialised to rediscover them). ``collect`` never raises.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from agent.collectors.nvml_aggregate import GpuAccumulator, GpuTick, NvmlTick, build_values
from agent.collectors.nvml_backend import (
    GpuInfo,
    GpuLostError,
    GpuSample,
    NvmlBackend,
    NvmlUnavailableError,
)
from agent.config import NvmlConfig
from agent.engine_gpus import indices_of
from detectors.snapshot import Reading, SourceStatus

log = logging.getLogger(__name__)


class NvmlSampler:
    """Reads every watched GPU once per :meth:`sample_once`; :meth:`drain` hands the tick's aggregates over.

    ``sample_once(now)`` is the whole sampling step and takes the time as an argument, so tests drive it
    directly; :meth:`start` only wraps it in a thread on a monotonic clock.
    """

    def __init__(
        self,
        backend: NvmlBackend,
        *,
        sample_interval_s: float = 0.1,
        process_interval_s: float = 1.0,
        energy_interval_s: float = 1.0,
        gpus: tuple[int, ...] = (),
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.sample_interval_s = sample_interval_s
        self.process_interval_s = process_interval_s
        self.energy_interval_s = energy_interval_s
        self.wanted = gpus
        #: the engine's GPUs by UUID (agent/engine_gpus.py): watched alone when ``gpus`` names none
        self.followed: tuple[str, ...] = ()
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._rng = rng or random.Random()
        self._clock = clock
        self.up = False
        self.error: str | None = "not initialised yet"
        self.gpu_info: tuple[GpuInfo, ...] = ()
        #: Thread CPU seconds spent in :meth:`sample_once` (for the agent's self-monitoring and the bench).
        self.cpu_seconds = 0.0
        self.rounds = 0
        self._failures = 0
        self._next_init_at = -math.inf
        self._last_slow_at = -math.inf
        self._last_process_at = -math.inf
        self._lock = threading.Lock()
        self._ticks: dict[int, GpuTick] = {}
        self._problems: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- sampling (sampler thread) -------------------------------------------------------------------
    def sample_once(self, now: float) -> None:
        """One round over all watched GPUs at monotonic time ``now``. Never raises."""
        started = time.thread_time()
        try:
            if self.up or (now >= self._next_init_at and self._try_init(now)):
                self._round(now)
        finally:
            self.cpu_seconds += time.thread_time() - started

    def _round(self, now: float) -> None:
        slow = now - self._last_slow_at >= self.energy_interval_s
        procs = now - self._last_process_at >= self.process_interval_s
        read: list[tuple[int, GpuSample, Mapping[int, int] | None]] = []
        lost: list[GpuLostError] = []
        try:
            self.backend.begin_round()
            for index in list(self._ticks):
                try:
                    sample = self.backend.sample(index, slow)
                    read.append((index, sample, self.backend.processes(index) if procs else None))
                except GpuLostError as error:
                    lost.append(error)
        except NvmlUnavailableError as error:
            self._go_down(now, str(error))
            return
        except Exception as error:  # a backend bug must not kill the thread or spin hot
            self._go_down(now, f"unexpected {type(error).__name__}: {error}")
            return
        self.rounds += 1
        self._last_slow_at = now if slow else self._last_slow_at
        self._last_process_at = now if procs else self._last_process_at
        with self._lock:
            for index, sample, processes in read:
                tick = self._ticks.get(index)
                if tick is None:  # no longer watched (follow() narrowed the set during the round)
                    continue
                tick.acc.add(sample)
                if sample.energy_joules is not None:
                    tick.energy_joules = sample.energy_joules
                if sample.power_limit_watts is not None:
                    tick.power_limit_watts = sample.power_limit_watts
                if processes is not None:
                    tick.processes = dict(processes)
            for gone in lost:
                log.warning("nvml: %s; its readings stop, other GPUs continue", gone)
                self._ticks.pop(gone.index, None)
                self._problems[gone.index] = str(gone)
            all_lost = bool(lost) and not self._ticks
        if all_lost:
            self._go_down(now, "every watched GPU is lost: " + "; ".join(self._problems.values()))

    def _try_init(self, now: float) -> bool:
        try:
            infos = self.backend.init()
        except Exception as error:  # NvmlUnavailableError, or anything a broken driver throws
            message = (
                str(error)
                if isinstance(error, NvmlUnavailableError)
                else f"unexpected {type(error).__name__}: {error}"
            )
            self._go_down(now, message)
            return False
        present = {info.index for info in infos}
        watched = [i for i in (self.wanted or self._engine_indices(infos) or sorted(present)) if i in present]
        problems = {
            i: f"gpu{i}: not present (backend sees {sorted(present)})"
            for i in self.wanted
            if i not in present
        }
        with self._lock:
            self._ticks = {i: GpuTick(i, GpuAccumulator()) for i in watched}
            self._problems = problems
        self.gpu_info = tuple(infos)
        self._failures = 0
        self._last_slow_at = self._last_process_at = -math.inf
        self.up, self.error = True, None
        driver = infos[0].driver_version if infos else "unknown"
        log.info(
            "nvml: %s backend up, watching %d GPU(s), driver %s", self.backend.kind, len(watched), driver
        )
        return True

    def _engine_indices(self, infos: Sequence[GpuInfo]) -> list[int]:
        """The followed UUIDs as this backend numbers them (re-read at every init: indices may move)."""
        return indices_of(self.followed, {info.index: info.uuid for info in infos})[0]

    def follow(self, uuids: Sequence[str] | None) -> None:
        """Watch only the engine's GPUs (``uuids`` from the probe), unless ``nvml.gpus`` names GPUs.

        ``None`` (the probe cannot name them) keeps watching every GPU. UUIDs this backend does not see
        are logged and left out; when it sees none of them, every GPU stays watched. Called on the event
        loop; the sampler thread picks the new set up at its next round.
        """
        if self.wanted or uuids is None:
            return
        indices, missing = indices_of(uuids, {info.index: info.uuid for info in self.gpu_info})
        if missing and self.gpu_info:
            log.warning(
                "nvml: the engine's GPU(s) %s are not among those this container sees; %s",
                ", ".join(missing),
                "watching the others of the engine's" if indices else "watching every GPU",
            )
        self.followed = tuple(uuids)
        if not indices:
            return
        with self._lock:
            if not self.up:
                return  # the next init applies it
            self._ticks = {i: self._ticks.get(i) or GpuTick(i, GpuAccumulator()) for i in indices}
            self._problems = {}
        log.info("nvml: watching the engine's GPU(s) %s, of %d seen", indices, len(self.gpu_info))

    def _go_down(self, now: float, message: str) -> None:
        if self.up or self._failures == 0:
            log.warning("nvml: %s; GPU readings stop, retrying with backoff", message)
        else:
            log.debug("nvml: still unavailable: %s", message)
        self.backend.shutdown()
        self._failures += 1
        # Exponential backoff with "equal jitter": half fixed, half random, so restarts do not synchronise.
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** min(self._failures - 1, 30))
        self._next_init_at = now + delay * (0.5 + 0.5 * self._rng.random())
        with self._lock:
            self._ticks = {}
        self.up, self.error = False, message

    # -- draining (event-loop thread) ----------------------------------------------------------------
    def drain(self) -> NvmlTick:
        """Hand over this tick's aggregates and start fresh ones; slow values carry over."""
        with self._lock:
            gpus = tuple(self._ticks.values())
            self._ticks = {
                t.index: GpuTick(t.index, GpuAccumulator(), t.energy_joules, t.power_limit_watts, t.processes)
                for t in gpus
            }
            problems = tuple(self._problems.values())
        return NvmlTick(self.up, self.error, gpus, problems)

    # -- thread ----------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="servepilot-nvml", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_at = self._clock()
        while not self._stop.is_set():
            self.sample_once(self._clock())
            next_at += self.sample_interval_s
            delay = next_at - self._clock()
            if delay < 0:  # fell behind (slow driver): skip missed rounds rather than burst
                next_at, delay = self._clock(), 0.0
            self._stop.wait(delay)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread; False when it is stuck in a driver call and did not finish in ``timeout_s``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def shutdown(self) -> None:
        """Release the backend and forget its GPUs; the next ``sample_once`` initialises it afresh.

        Call only with the thread stopped: NVML handles must not be used after ``nvmlShutdown``.
        """
        self.backend.shutdown()
        with self._lock:
            self._ticks, self._problems = {}, {}
        self._next_init_at = -math.inf
        self.up, self.error = False, "closed"


def make_backend(cfg: NvmlConfig) -> NvmlBackend | None:
    """The backend ``cfg.backend`` names, or ``None`` for ``off``. Never falls back to another one."""
    if cfg.backend == "nvml":
        from agent.collectors.nvml_real import RealNvmlBackend

        return RealNvmlBackend()
    if cfg.backend == "simulated":
        from agent.collectors.nvml_simulated import SimulatedNvmlBackend

        return SimulatedNvmlBackend(cfg.simulated_url, cfg.simulated_timeout_s)
    return None


class NvmlCollector:
    """The ``nvml`` source: owns the sampler thread and turns each tick's aggregates into a Reading."""

    name = "nvml"

    def __init__(self, cfg: NvmlConfig, backend: NvmlBackend | None = None) -> None:
        self.cfg = cfg
        backend = backend if backend is not None else make_backend(cfg)
        self.sampler: NvmlSampler | None = None
        if backend is not None:
            self.sampler = NvmlSampler(
                backend,
                sample_interval_s=cfg.sample_interval_s,
                process_interval_s=cfg.process_interval_s,
                energy_interval_s=cfg.energy_interval_s,
                gpus=cfg.gpus,
            )

    @property
    def up(self) -> bool:
        """Whether the backend is initialised and answering (``servepilot_nvml_up``)."""
        return self.sampler is not None and self.sampler.up

    @property
    def gpu_info(self) -> tuple[GpuInfo, ...]:
        """Index, name, UUID and driver version of every GPU the backend sees."""
        return self.sampler.gpu_info if self.sampler is not None else ()

    def start(self) -> None:
        """Start the sampler thread (it initialises the backend itself, so this never blocks or fails)."""
        if self.sampler is not None:
            self.sampler.start()

    async def collect(self, now: float) -> Reading:
        started = time.perf_counter()
        if self.sampler is None:
            return Reading.empty(self.name, now, "disabled by config (nvml.backend: off)")
        try:
            tick = self.sampler.drain()
            if not tick.up:
                return Reading.failed(self.name, now, tick.error or "NVML is down", self._took(started))
            values = build_values(tick.gpus)
            problem = "; ".join(tick.problems) or None
            if not values:
                if problem:
                    return Reading.failed(self.name, now, problem, self._took(started))
                why = "no GPU samples since the last tick" if tick.gpus else "no GPUs to watch"
                return Reading.empty(self.name, now, why, self._took(started))
            info = {"backend": self.sampler.backend.kind, "gpus": str(len(tick.gpus))}
            if self.sampler.gpu_info:
                info["driver_version"] = self.sampler.gpu_info[0].driver_version
                # the watched GPUs' model(s): what learned figures belong to (detectors/serving_setup.py)
                names = {gpu.index: gpu.name for gpu in self.sampler.gpu_info}
                info["gpu_names"] = ",".join(sorted({names.get(g.index, "?") for g in tick.gpus}))
            return Reading(self.name, now, SourceStatus.OK, values, problem, self._took(started), info)
        except Exception as error:  # collect() never raises
            return Reading.failed(self.name, now, f"{type(error).__name__}: {error}", self._took(started))

    @staticmethod
    def _took(started: float) -> float:
        return time.perf_counter() - started

    async def close(self) -> None:
        """Stop the sampler thread, then release the backend (``nvmlShutdown``)."""
        if self.sampler is None:
            return
        if await asyncio.to_thread(self.sampler.stop):
            self.sampler.shutdown()
        else:
            log.warning("nvml: sampler thread stuck in a driver call; skipping nvmlShutdown")
