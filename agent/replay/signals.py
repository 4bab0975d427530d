"""The snapshot the live collectors would produce, read straight from the simulator core's state.

Names follow :mod:`detectors.snapshot` and the live collectors: ``engine.*`` as the engine /metrics
collector publishes them (gauges, per-second counter rates, histogram quantiles over a window computed
from bucket deltas with the same ``bucket_quantile`` the live path uses), ``nvml.gpu0.*`` as the NVML
collector's tick aggregates, and ``gate.*`` as the admission gate's. No HTTP and no text parsing, which
is what lets a replay run thousands of times faster than real time.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numpy.typing import NDArray

from agent.collectors.derive import bucket_quantile, tokens_per_observation
from detectors.snapshot import Reading, Snapshot, SourceStatus
from simulator.engine import EngineCore
from simulator.stats import Histogram
from simulator.telemetry import memory_state

_QUANTILES = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))


class _WindowedHistogram:
    """Quantiles of the observations a cumulative histogram gained over the last ``window_s``."""

    def __init__(self, histogram: Histogram, window_s: float) -> None:
        self.histogram = histogram
        self.window_s = window_s
        self.bounds: NDArray[np.float64] = np.append(histogram.bounds, np.inf)
        self._history: deque[tuple[float, NDArray[np.int64], float]] = deque()

    def values(self, prefix: str, now: float, out: dict[str, float]) -> None:
        h = self.histogram
        history = self._history
        history.append((now, h.counts.copy(), h.sum))
        while len(history) > 1 and history[1][0] <= now - self.window_s:
            history.popleft()
        _, base, base_sum = history[0]
        delta = np.cumsum(h.counts - base).astype(np.float64)
        count = float(delta[-1])
        if count <= 0:
            return
        out[f"{prefix}.mean"] = (h.sum - base_sum) / count
        for q, name in _QUANTILES:
            value = bucket_quantile(q, self.bounds, delta)
            if value is not None:
                out[f"{prefix}.{name}"] = value


class _TokensPerStep:
    """Decode tokens per ITL observation over the window, with :class:`_WindowedHistogram`'s base rule,
    for an engine that drafts: the simulator observes one ITL gap per step, as vLLM does, and a drafting
    step gives a request several tokens; the live collector divides vLLM's ITL by this (the name table's
    ``per_token``, :mod:`agent.collectors.derive`), and so does the replay's snapshot."""

    def __init__(self, core: EngineCore, window_s: float) -> None:
        self.core = core
        self.window_s = window_s
        self._history: deque[tuple[float, float, float, float]] = deque()

    def update(self, now: float) -> float | None:
        stats = self.core.stats
        history = self._history
        history.append((now, float(stats.generation_tokens), float(stats.ttft.count), float(stats.itl.count)))
        while len(history) > 1 and history[1][0] <= now - self.window_s:
            history.popleft()
        _, tokens, firsts, observed = history[0]
        current = history[-1]
        return tokens_per_observation(current[1] - tokens, current[2] - firsts, current[3] - observed)


class CoreSignals:
    """Builds one :class:`Snapshot` per tick from an :class:`EngineCore` (and the replay's gate counts).

    ``window_s`` plays the role of ``engine.quantile_window_s``; rates are over the tick interval.
    """

    def __init__(self, core: EngineCore, *, window_s: float = 10.0, gpu: int = 0) -> None:
        self.core = core
        self._ttft = _WindowedHistogram(core.stats.ttft, window_s)
        self._itl = _WindowedHistogram(core.stats.itl, window_s)
        self._per_step = _TokensPerStep(core, window_s) if core.spec is not None else None
        self._prefix = f"nvml.gpu{gpu}."
        self._last: tuple[float, int, int, int, int, float, float, float] | None = None

    def _counters(self, now: float) -> tuple[float, int, int, int, int, float, float, float]:
        core = self.core
        s, g = core.stats, core.gpu_counters
        finished = sum(s.request_success.values())
        return (
            now,
            s.generation_tokens,
            s.prompt_tokens,
            finished,
            s.preemptions,
            g.busy_s,
            g.mem_busy_s,
            g.energy_j,
        )

    def snapshot(self, now: float, gate: dict[str, float]) -> Snapshot:
        """The snapshot at ``now``; ``gate`` holds the replay gate's own values (limit, errors, SLO)."""
        core = self.core
        core.idle_until(now)
        current = self._counters(now)
        last, self._last = self._last, current
        engine: dict[str, float] = {
            "engine.requests_running": float(core.num_running),
            "engine.requests_waiting": float(core.num_waiting),
            "engine.kv_cache_usage_ratio": core.kv_usage,
            # what the control API's state reports live; the token budget policy reads it
            "engine.max_num_batched_tokens": float(core.settings.max_num_batched_tokens),
        }
        nvml: dict[str, float] = {}
        p = self._prefix
        if last is not None and current[0] > last[0]:
            span = current[0] - last[0]
            engine["engine.generation_tokens_per_second"] = (current[1] - last[1]) / span
            engine["engine.prompt_tokens_per_second"] = (current[2] - last[2]) / span
            engine["engine.requests_finished_per_second"] = (current[3] - last[3]) / span
            engine["engine.preemptions_per_second"] = (current[4] - last[4]) / span
            # The core may have accounted a step that ends after ``now``: clamp shares to [0, 1].
            nvml[p + "utilization_ratio.mean"] = min(1.0, max(0.0, (current[5] - last[5]) / span))
            nvml[p + "memory_bandwidth_utilization_ratio.mean"] = min(
                1.0, max(0.0, (current[6] - last[6]) / span)
            )
            nvml[p + "power_watts.mean"] = max(0.0, (current[7] - last[7]) / span)
        self._ttft.values("engine.ttft_seconds", now, engine)
        self._itl.values("engine.itl_seconds", now, engine)
        per_step = self._per_step.update(now) if self._per_step is not None else None
        if per_step is not None:  # per token, as the live collector reads vLLM's
            for name in ("mean", *(q for _, q in _QUANTILES)):
                key = f"engine.itl_seconds.{name}"
                if key in engine:
                    engine[key] /= per_step
        g = core.gpu_counters
        memory = memory_state(core, now)
        nvml[p + "sm_clock_hz.mean"] = g.clock_mhz * 1e6
        nvml[p + "temperature_celsius.mean"] = core.thermal.temperature_c
        nvml[p + "energy_joules"] = g.energy_j
        nvml[p + "power_limit_watts"] = core.settings.power_limit_w
        nvml[p + "memory_used_bytes"] = memory.process
        nvml[p + "memory_total_bytes"] = memory.total
        readings = {
            "engine": Reading("engine", now, SourceStatus.OK, engine),
            "nvml": Reading("nvml", now, SourceStatus.OK, nvml),
            "gate": Reading("gate", now, SourceStatus.OK, gate),
        }
        return Snapshot.from_readings(now, readings)
