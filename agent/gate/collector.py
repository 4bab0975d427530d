"""The gate as a :class:`~agent.collectors.base.Collector`, so the loop reads its signals like any source.

The gate lives in the agent's process, so "collecting" is reading its counters: it cannot fail the way a
scrape can, but it still never raises out of :meth:`collect`.
"""

from __future__ import annotations

import time

from agent.gate.proxy import Gate
from detectors.snapshot import Reading, SourceStatus
from detectors.stall import ENGINE_UNANSWERED
from policies import knobs


class GateCollector:
    """Reads ``gate.*`` signals from a running :class:`Gate` once per tick."""

    name = "gate"

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self._totals = self._read_totals()
        self._by_upstream = dict(gate.stats.by_upstream)
        self._by_priority = dict(gate.stats.by_priority)

    def _read_totals(self) -> tuple[int, int, int]:
        stats = self.gate.stats
        return stats.answered, stats.errors, stats.slo_bad

    async def collect(self, now: float) -> Reading:
        started = time.perf_counter()
        try:
            values = self.gate.snapshot_values()
            # this tick's answers, for the breaker's burn rate and the canary's checks
            totals, last = self._read_totals(), self._totals
            self._totals = totals
            values[knobs.GATE_REQUESTS], values[knobs.GATE_ERRORS], values[knobs.GATE_SLO_BAD] = (
                float(a - b) for a, b in zip(totals, last, strict=True)
            )
            values.update(self._per_upstream())
            values.update(self._per_class())
            engine = self.gate.engine_upstream
            if engine is not None:  # the engine_stall detector's view of what waits on the engine
                values[ENGINE_UNANSWERED] = float(self.gate.held.unanswered(engine))
        except Exception as error:  # a bug here must not fail the tick
            return Reading.failed(
                self.name, now, f"{type(error).__name__}: {error}", time.perf_counter() - started
            )
        return Reading(self.name, now, SourceStatus.OK, values, duration_s=time.perf_counter() - started)

    def _per_upstream(self) -> dict[str, float]:
        """This tick's answers, 5xx and SLO misses per upstream that answered, each one's health, and the
        requests it holds that are already late (``late``: a level, not a count of the tick's answers)."""
        values: dict[str, float] = {}
        by_upstream, last = dict(self.gate.stats.by_upstream), self._by_upstream
        self._by_upstream = by_upstream
        late = self.gate.late_at_upstreams()
        values[knobs.GATE_LATE] = float(sum(late.values()))
        for name, upstream in self.gate.pool.upstreams.items():
            values[knobs.upstream_signal(name, "up")] = 1.0 if upstream.healthy else 0.0
            values[knobs.upstream_signal(name, "late")] = float(late.get(name, 0))
            now, before = by_upstream.get(name, (0, 0, 0)), last.get(name, (0, 0, 0))
            for what, a, b in zip(("requests", "errors", "slo_bad"), now, before, strict=True):
                values[knobs.upstream_signal(name, what)] = float(a - b)
        return values

    def _per_class(self) -> dict[str, float]:
        """This tick's answers and SLO misses per class that was answered (each judged by its own
        targets)."""
        values: dict[str, float] = {}
        by_priority, last = dict(self.gate.stats.by_priority), self._by_priority
        self._by_priority = by_priority
        for name, (answered, slo_bad) in by_priority.items():
            before = last.get(name, (0, 0))
            values[knobs.class_signal(name, "requests")] = float(answered - before[0])
            values[knobs.class_signal(name, "slo_bad")] = float(slo_bad - before[1])
        return values

    async def close(self) -> None:
        """Nothing to release: the gate's lifecycle belongs to whoever started it."""
