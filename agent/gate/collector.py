"""The gate as a :class:`~agent.collectors.base.Collector`, so the loop reads its signals like any source.

The gate lives in the agent's process, so "collecting" is reading its counters: it cannot fail the way a
scrape can, but it still never raises out of :meth:`collect`.
"""

from __future__ import annotations

import time

from agent.gate.proxy import Gate
from detectors.snapshot import Reading, SourceStatus


class GateCollector:
    """Reads ``gate.*`` signals from a running :class:`Gate` once per tick."""

    name = "gate"

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def collect(self, now: float) -> Reading:
        started = time.perf_counter()
        try:
            values = self.gate.snapshot_values()
        except Exception as error:  # a bug here must not fail the tick
            return Reading.failed(
                self.name, now, f"{type(error).__name__}: {error}", time.perf_counter() - started
            )
        return Reading(self.name, now, SourceStatus.OK, values, duration_s=time.perf_counter() - started)

    async def close(self) -> None:
        """Nothing to release: the gate's lifecycle belongs to whoever started it."""
