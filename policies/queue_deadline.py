"""The gate's queue deadline (``gate.max_queue_wait_s``): answer 503 to what can no longer meet the TTFT SLO.

A request's TTFT is its wait for admission plus its prefill. Once it has waited longer than the SLO
minus its prefill time it will miss whatever happens next, and serving it anyway spends GPU time the
requests still inside the SLO need; under a burst past capacity that is how a backlog makes every
later request late. The gate answers a request that waited ``max_queue_wait_s`` with a 503 and
``Retry-After``, so the deadline wants to be "SLO minus prefill", and prefill time depends on the
prompt lengths and the load of the moment. So the deadline is steered by what it produces, the TTFT of
the requests that were admitted (expired ones have none)::

    target  = target_share * ttft_slo                       (0.95: aim the p99 a little under the SLO)
    D      += gain * (target - ttft_p99)                     (the window's p99 TTFT)
    D       = min(ttft_slo, max(floor_share * ttft_slo, D))

Under a backlog the admitted requests' TTFT is about D + prefill, so D settles near ``target -
prefill``; when the queue is short, TTFT is far under the target and D returns to the SLO, where it
binds nothing (no request waits that long). A change smaller than ``min_change_s`` is not proposed
(hysteresis), and the arbiter cools the knob down. The floor (80% of the SLO) bounds how early a
request may be shed: one deadline serves short and long prompts alike, so a deadline far under the SLO
sheds short prompts that still had time, and a misread signal must not shed much.

The parameters were chosen on the replayed traces (docs/policies.md, "Goodput on the traces"), among
five sets tried at their operating loads: gain 0.5 or 0.25, target 0.9, 0.95 or 1.0 of the SLO, floor
0.5 or 0.8 of it. This set was the only one at or above the best static setting on all four.
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
class QueueDeadline:
    """The queue deadline controller (see module docstring for the rule)."""

    ttft_slo_s: float
    target_share: float = 0.95
    floor_share: float = 0.8
    gain: float = 0.25
    min_change_s: float = 0.1
    name: str = "queue_deadline"

    def __post_init__(self) -> None:
        if not self.ttft_slo_s > 0:
            raise ValueError("ttft_slo_s must be > 0")
        if not 0 < self.floor_share <= self.target_share <= 1:
            raise ValueError("need 0 < floor_share <= target_share <= 1")
        if not 0 < self.gain <= 1:
            raise ValueError("gain must be in (0, 1]")

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: float | None, now: float
    ) -> tuple[float | None, list[Proposal]]:
        slo = self.ttft_slo_s
        published = snapshot.get(knobs.QUEUE_WAIT)
        current = published if published is not None else (state if state is not None else slo)
        ttft = snapshot.get(knobs.TTFT_P99)
        if ttft is None:
            return current, []  # no first token in the window: nothing to steer by
        target = self.target_share * slo
        steered = current + self.gain * (target - ttft)
        wanted = min(slo, max(self.floor_share * slo, steered))
        if abs(wanted - current) < self.min_change_s:
            return current, []
        if wanted < current <= steered:  # the bounds moved it, not the TTFT: say so
            why = f"a {current:g}s queue wait is past the TTFT SLO {slo:g}s: a request that waited it is late"
        elif steered <= current < wanted:
            why = f"a {current:g}s queue wait is under the floor {self.floor_share:.0%} of the TTFT SLO"
        elif wanted < current:
            why = f"admitted requests' TTFT p99 {ttft:.2f}s over {target:.2f}s: shed earlier"
        else:
            why = f"TTFT p99 {ttft:.2f}s under {target:.2f}s: wait longer before shedding"
        proposal = Proposal(self.name, knobs.QUEUE_WAIT, round(wanted, 3), why, PRIORITY["slo_guard"])
        return wanted, [proposal]
