"""The brain a replay runs: the live loop's pure ``think`` (detectors, then policies) and the arbiter.

``Loop.think`` is the very code the sidecar runs each tick; the replay only swaps the collectors for
:class:`~agent.replay.signals.CoreSignals` and the actuators for the simulator core. With
:class:`Steering` (``policies.itl_steering: served_classes``), the policies are retuned to the ITL target
of the classes served lately before each tick, by the same rule and ``retune`` the sidecar uses, and each
move comes back as a decision on ``policies.itl_target_s`` for the replay's record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.config import PolicyConfig
from agent.itl_steering import AUDIT_KNOB, steered_itl
from agent.loop import Loop
from agent.store import Store
from detectors.base import Detector, Finding
from detectors.snapshot import Snapshot
from policies.arbiter import Arbiter, ArbiterState, Decision
from policies.base import Policy, Proposal
from policies.registry import retune


@dataclass
class Steering:
    """What ITL steering needs: the policies section (its SLO, class targets and window), each class's
    last arrival (written by the replay), the batch bounds the policies were built with, and the
    target they steer to now."""

    policies: PolicyConfig
    last_seen: dict[str, float]
    batch_bounds: tuple[float, float]
    itl_s: float


class Brain:
    """Policies through the live loop's ``think``, merged by the :class:`Arbiter`."""

    def __init__(
        self,
        policies: Sequence[Policy],
        arbiter: Arbiter,
        *,
        detectors: Sequence[Detector] = (),
        interval_s: float = 1.0,
        steering: Steering | None = None,
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
        self.steering = steering
        #: the last tick's findings and proposals, for a harness that feeds the agent's other parts
        #: (bench/soak.py); thinking again to get them would feed every detector the tick twice
        self.findings: tuple[Finding, ...] = ()
        self.proposals: tuple[Proposal, ...] = ()

    def control(self, snapshot: Snapshot, actual: dict[str, float | str]) -> list[Decision]:
        steered = self._steer(snapshot.now) if self.steering is not None else None
        self.findings, self.proposals = self.loop.think(snapshot)
        self.state, decisions = self.arbiter.decide(self.proposals, actual, self.state, snapshot.now)
        return decisions if steered is None else [steered, *decisions]

    def _steer(self, now: float) -> Decision | None:
        """Retune the policies when the classes served lately ask for another ITL target; the move."""
        s = self.steering
        assert s is not None
        target = steered_itl(s.policies, s.last_seen, now)
        if target.itl_s == s.itl_s:
            return None
        p = s.policies
        try:
            retuned = [
                retune(
                    policy,
                    ttft_slo_s=p.ttft_slo_s,
                    itl_slo_s=target.itl_s,
                    batch_bounds=s.batch_bounds,
                    schedule=None,
                )
                for policy in self.loop.policies
            ]
        except ValueError:  # a target the policies do not take: they keep theirs, as the sidecar's do
            return None
        self.loop.policies[:] = retuned
        move = Decision(AUDIT_KNOB, target.itl_s, s.itl_s, "itl_steering", target.reason, now)
        s.itl_s = target.itl_s
        return move
