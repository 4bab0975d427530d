"""SLO-gated energy saving: the lowest GPU clock that still meets the latency SLO (after throttLL'eM).

The policy walks a ladder of SM clocks (``levels_mhz``, high to low). Each tick it compares the latency
signals with the SLO, with two margins that make a dead band::

    misses = the share of the gate's answers that missed their targets over verdict_window_s, or of
             one class's over class_window_s, whichever is worse (each with min_answers)
    risk  = itl_mean > up * h * itl_slo  or  ttft_p99 > up * ttft_slo  or  misses > miss_max
    slack = itl_mean < down * h * itl_slo and (ttft_p99 or 0) < down * ttft_slo
            and misses <= miss_max / 2  (or too few answers to say)

    peak (schedule) or risk  ->  climb ``step_up`` levels at once          (priority: SLO guard)
    slack for ``dwell_s``     ->  go one level lower                       (priority: energy)

Climbing is immediate and steep, descending slow and one level at a time, so a burst is met at full
speed and the clock only drifts down again once latency has shown room for a while. Restoring is
proposed at the SLO guard's priority: energy never outranks the SLO.

The queue length is neither a risk nor a reason to hold: the SLO's own signals decide both ways. On a
coding service every burst of 2k-token prompts queues a few requests that a 10 s TTFT SLO has room for;
climbing two levels at each (the rule was ``queue > 4``; a Little's-law wait over half the SLO did the
same, since few long requests finish per second), or holding while anything waits, kept the clock near
the top for most busy time. The admission gate's queue deadline keeps a queue from growing without the
TTFT p99 showing it. On the whole Azure 2024 coding week (x0.06, code lengths, ``bench/energy.py``)
auto+energy saved 18.5% of the engine default's energy per token with the queue holding the clock and
23.6% without (SLO violations 0.13% and 1.79% of requests; the engine default at full clock 2.45%,
auto at full clock 0.09%); on day 1 alone, 11.9% with the ``queue > 4`` climb. Together with the token
budget allowed its 512 floor under the energy policy (``policies/registry.py``).

The engine-wide mean ITL is a proxy for what is judged: each answer's own mean ITL against its own
class's target. The spread between them grows as the target tightens. Replaying priority classes with an
interactive class steered to 0.05 s (``policies.itl_steering: served_classes``), the ladder held the mean
just under 0.0475 s while the class's answers reached 0.073 s at p99, and it met its target on 84.75% of
them (99.81% at full clock). So the gate's own verdicts gate the ladder too: more than ``miss_max`` of
the answers missing their targets over the last ``verdict_window_s`` climbs, and the ladder descends only
while they stay under half of it. The same holds per class over ``class_window_s`` (longer: a class is a
share of the traffic, and needs ``min_answers`` too), so a small interactive class missing its targets
climbs the ladder though the pod as a whole meets its own. Without a gate there are no verdicts, and the
rule is as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import PRIORITY
from policies.base import Proposal
from policies.schedule import Schedule
from policies.windows import Buckets, rolling_sum, window_totals

#: Width of the buckets the gate's verdicts are summed in.
VERDICT_BUCKET_S = 10.0


@dataclass(frozen=True)
class EnergyState:
    level: int
    slack_since: float | None
    #: the gate's (good, bad) answers per bucket, over the last ``verdict_window_s``
    verdicts: Buckets = ()
    #: the same per class, over the last ``class_window_s``
    by_class: tuple[Buckets, ...] = ()


@dataclass(frozen=True)
class Energy:
    """Clock ladder under an SLO gate; ``schedule`` (optional) forces full clock in ``peak`` windows."""

    ttft_slo_s: float
    itl_slo_s: float
    levels_mhz: tuple[float, ...]
    headroom: float = 0.95
    up: float = 1.0
    down: float = 0.8
    dwell_s: float = 30.0
    step_up: int = 2
    #: the share of the gate's answers missing their targets above which the ladder climbs
    miss_max: float = 0.02
    verdict_window_s: float = 60.0
    class_window_s: float = 300.0
    #: fewer answers than this in the window say nothing (a quiet night must not pin the clock)
    min_answers: float = 20.0
    schedule: Schedule | None = None
    #: The knob the ladder drives: the SM clock (``levels_mhz`` in MHz) or, where only the power limit
    #: may be set, the power limit (the same ladder in W): both lower the clock the GPU runs at.
    knob: str = knobs.SM_CLOCK
    name: str = "energy"

    def __post_init__(self) -> None:
        if not self.levels_mhz or list(self.levels_mhz) != sorted(self.levels_mhz, reverse=True):
            raise ValueError("levels_mhz must be non-empty and sorted from high to low")
        if self.knob not in (knobs.SM_CLOCK, knobs.POWER_LIMIT):
            raise ValueError(f"knob must be {knobs.SM_CLOCK} or {knobs.POWER_LIMIT}, got {self.knob!r}")
        if not 0 < self.down < self.up:
            raise ValueError("margins must satisfy 0 < down < up")

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: EnergyState | None, now: float
    ) -> tuple[EnergyState, list[Proposal]]:
        state = state or EnergyState(0, None)
        itl = snapshot.get(knobs.ITL_MEAN)
        ttft = snapshot.get(knobs.TTFT_P99) or 0.0
        queue = snapshot.get(knobs.WAITING)
        level = state.level
        requests = snapshot.get(knobs.GATE_REQUESTS) or 0.0
        bad = min(requests, snapshot.get(knobs.GATE_SLO_BAD) or 0.0)
        keep = self.verdict_window_s + VERDICT_BUCKET_S
        verdicts = rolling_sum(state.verdicts, now, VERDICT_BUCKET_S, keep, requests - bad, bad)
        misses, whose = self._share(verdicts, now, self.verdict_window_s), "the gate's answers"
        by_class = []
        for i, name in enumerate(knobs.CLASSES):
            answered = snapshot.get(knobs.class_signal(name, "requests")) or 0.0
            missed = min(answered, snapshot.get(knobs.class_signal(name, "slo_bad")) or 0.0)
            mine = state.by_class[i] if i < len(state.by_class) else ()
            if answered:  # a class with no answer this tick adds nothing (old buckets fall out of the sum)
                keep_s = self.class_window_s + VERDICT_BUCKET_S
                mine = rolling_sum(mine, now, VERDICT_BUCKET_S, keep_s, answered - missed, missed)
            by_class.append(mine)
            share = self._share(mine, now, self.class_window_s)
            if share is not None and (misses is None or share > misses):
                misses, whose = share, f"the {name} class's answers"
        carried = (verdicts, tuple(by_class))
        if itl is None or queue is None:
            # no latency evidence (or no engine data at all): run at full clock rather than guess
            return EnergyState(0, None, *carried), self._propose(
                0, "no latency signal: full clock", PRIORITY["slo_guard"]
            )
        target = self.headroom * self.itl_slo_s
        peak = self.schedule is not None and self.schedule.mode_at(now) == "peak"
        missing = misses is not None and misses > self.miss_max
        risk = itl > self.up * target or ttft > self.up * self.ttft_slo_s or missing
        if peak or risk:
            new = max(0, level - self.step_up) if not peak else 0
            if peak:
                why = "peak window"
            elif missing:
                why = f"{misses:.1%} of {whose} missed their targets (> {self.miss_max:.0%})"
            else:
                why = f"ITL {itl:.3f}s / TTFT {ttft:.2f}s at risk"
            return EnergyState(new, None, *carried), self._propose(new, why, PRIORITY["slo_guard"])
        slack = (
            itl < self.down * target
            and ttft < self.down * self.ttft_slo_s
            and (misses is None or misses <= self.miss_max / 2)
        )
        if not slack:
            return EnergyState(level, None, *carried), self._propose(
                level, "inside the dead band: hold", PRIORITY["energy"]
            )
        since = state.slack_since if state.slack_since is not None else now
        if now - since >= self.dwell_s and level + 1 < len(self.levels_mhz):
            level += 1
            since = now
            why = f"ITL {itl:.3f}s < {self.down:.0%} of target for {self.dwell_s:g}s: one level lower"
        else:
            why = "latency has room: hold while the dwell runs"
        return EnergyState(level, since, *carried), self._propose(level, why, PRIORITY["energy"])

    def _share(self, buckets: Buckets, now: float, window_s: float) -> float | None:
        """The share of missed answers over ``window_s``; None with fewer than ``min_answers``."""
        good, missed = window_totals(buckets, now, VERDICT_BUCKET_S, window_s)
        return missed / (good + missed) if good + missed >= self.min_answers else None

    def _propose(self, level: int, why: str, priority: int) -> list[Proposal]:
        clock = self.levels_mhz[min(max(level, 0), len(self.levels_mhz) - 1)]
        return [Proposal(self.name, self.knob, clock, why, priority)]
