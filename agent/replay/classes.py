"""Priority classes in a replay: each request's class, that class's targets and queue deadline, and the
ITL target the policies steer to.

Live, the gate gives each request a class (``high``, ``normal``, ``low``), judges its answer by the
class's own targets (``policies.slo_by_priority``, else the SLO), turns it away after the class's own
deadline (``gate.max_queue_wait_s`` x the class's TTFT target / the SLO's, at most an hour) and, with
``policies.itl_steering: served_classes``, has the policies steer the batch to the tightest ITL target of
the classes served lately (:mod:`agent.itl_steering`). A replay with a priority mix does the same in
virtual time, with the same config section and the same rules, so an operator can see on a real trace
what each class would get before turning them on.

Each request's class is drawn from the mix with the replay's seed, so every policy of one replay (and the
static settings of a sweep) serves the same requests in the same classes. The classes wait in the live
gate's own admission queue (:func:`agent.replay.runner.gate_for`): its high reserve, its aging (a request
that waited 200 ms ranks one class up), each class's deadline, its queue bound. The engine behind it
schedules by each request's own class (vLLM's priority policy, as ``gate.engine_priority`` asks for).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from agent.config import PolicyConfig, priority_targets
from agent.gate.admission import Priority, class_wait_scales
from agent.replay.slo import Slo
from policies import knobs

#: The classes, in the engine's priority order (vLLM: lower first), so a class's index is its priority.
CLASSES: tuple[str, ...] = knobs.CLASSES


@dataclass(frozen=True)
class ClassPlan:
    """The priority mix (class -> share, any positive scale) and the policies section that gives each
    class its targets and says how the policies steer (``slo_by_priority``, ``itl_steering``,
    ``served_window_s``; its ``ttft_slo_s``/``itl_slo_s`` are the replay's SLO)."""

    mix: Mapping[str, float]
    policies: PolicyConfig

    def __post_init__(self) -> None:
        unknown = sorted(set(self.mix) - set(CLASSES))
        if unknown:
            raise ValueError(f"priority mix: unknown class {unknown[0]!r} (classes: {', '.join(CLASSES)})")
        if any(not share >= 0 or not np.isfinite(share) for share in self.mix.values()):
            raise ValueError(f"priority mix: shares must be finite and >= 0, got {dict(self.mix)}")
        if sum(self.mix.values()) <= 0:
            raise ValueError(f"priority mix needs a share above 0, got {dict(self.mix)}")

    def draw(self, n: int, seed: int) -> NDArray[np.int64]:
        """``n`` class indices (into :data:`CLASSES`), drawn from the mix with ``seed``."""
        shares = np.array([self.mix.get(name, 0.0) for name in CLASSES], dtype=np.float64)
        rng = np.random.default_rng([seed, 0x5EED])  # apart from the workload's own draws
        return rng.choice(len(CLASSES), size=n, p=shares / shares.sum()).astype(np.int64)

    def targets(self) -> tuple[Slo, ...]:
        """Each class's (TTFT, mean ITL) targets, by index: its own, else the SLO's."""
        p = self.policies
        own = priority_targets(p)
        return tuple(Slo(*own.get(name, (p.ttft_slo_s, p.itl_slo_s))) for name in CLASSES)

    def wait_scales(self) -> tuple[float, ...]:
        """Each class's queue deadline over the gate's (by index), as the live gate scales it
        (:func:`~agent.gate.admission.class_wait_scales`; the deadline is at most an hour)."""
        scales = class_wait_scales(priority_targets(self.policies), self.policies.ttft_slo_s)
        return tuple(scales[Priority[name.upper()]] for name in CLASSES)
