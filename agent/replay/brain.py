"""The brain a replay runs: the live loop's pure ``think`` (detectors, then policies) and the arbiter.

``Loop.think`` is the very code the sidecar runs each tick; the replay only swaps the collectors for
:class:`~agent.replay.signals.CoreSignals` and the actuators for the simulator core.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.loop import Loop
from agent.store import Store
from detectors.base import Detector
from detectors.snapshot import Snapshot
from policies.arbiter import Arbiter, ArbiterState, Decision
from policies.base import Policy


class Brain:
    """Policies through the live loop's ``think``, merged by the :class:`Arbiter`."""

    def __init__(
        self,
        policies: Sequence[Policy],
        arbiter: Arbiter,
        *,
        detectors: Sequence[Detector] = (),
        interval_s: float = 1.0,
    ) -> None:
        self.loop = Loop(
            [],
            Store(points_per_series=16, max_series=16),
            interval_s=interval_s,
            source_timeout_s=interval_s,
            detectors=detectors,
            policies=policies,
        )
        self.arbiter = arbiter
        self.state: ArbiterState | None = None

    def control(self, snapshot: Snapshot, actual: dict[str, float | str]) -> list[Decision]:
        _findings, proposals = self.loop.think(snapshot)
        self.state, decisions = self.arbiter.decide(proposals, actual, self.state, snapshot.now)
        return decisions
