"""The published batch-sizing rule, kept as the baseline every other batch policy is measured against.

Each tick, from GPU utilisation ``u``, memory-bandwidth utilisation ``m`` and queue depth ``q``::

    u < 0.60 and m < 0.70   ->  limit x 1.5     (the GPU is idle: batch more)
    q > 20   and u < 0.80   ->  limit x 1.2     (a queue and some headroom)
    otherwise               ->  limit x 0.8
    limit = min(upper, max(lower, limit))       default [8, 32]

It ignores latency entirely, which is why it is a baseline and not the default. The queue is the engine's
plus the gate's: behind the gate the requests the limit holds back wait in the gate, and the engine's own
queue stays near empty (the replay has no gate in front; there it is the engine's alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import PRIORITY
from policies.base import Proposal


@dataclass(frozen=True)
class SeedState:
    limit: float


@dataclass(frozen=True)
class SeedBatch:
    """The seed rule; bounds configurable (``lower``, ``upper``)."""

    lower: float = 8.0
    upper: float = 32.0
    name: str = "batch_seed"

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: SeedState | None, now: float
    ) -> tuple[SeedState | None, list[Proposal]]:
        util = snapshot.get(knobs.GPU_UTIL)
        if util is None:
            return state, []  # no GPU reading this tick: hold, never guess
        bandwidth = snapshot.get(knobs.MEM_BW_UTIL) or 0.0
        queue = (snapshot.get(knobs.WAITING) or 0.0) + (snapshot.get(knobs.GATE_QUEUE) or 0.0)
        current = snapshot.get(knobs.GATE_LIMIT)
        limit = state.limit if state is not None else (current if current is not None else self.upper)
        if util < 0.60 and bandwidth < 0.70:
            factor, why = 1.5, f"GPU util {util:.0%} < 60% and bandwidth {bandwidth:.0%} < 70%"
        elif queue > 20 and util < 0.80:
            factor, why = 1.2, f"queue {queue:.0f} > 20 and GPU util {util:.0%} < 80%"
        else:
            factor, why = 0.8, f"GPU util {util:.0%}, bandwidth {bandwidth:.0%}, queue {queue:.0f}"
        limit = min(self.upper, max(self.lower, limit * factor))
        proposal = Proposal(
            self.name, knobs.BATCH, round(limit), f"x{factor:g}: {why}", PRIORITY["throughput"]
        )
        return SeedState(limit), [proposal]
