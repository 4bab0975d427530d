"""Multi-level circuit breaker: L0 normal, L1 smaller batch, L2 fp8 upstream, L3 small model.

A state machine with an explicit transition table (after gobreaker): ``(phase, event) -> (phase, step)``.
Each tick one event is derived from the signals, and a transition is taken only when the table allows it
and ``dwell_s`` has passed since the last level change, so the level changes at most once per dwell::

    steady  + trip     -> steady, +1      escalate one level
    steady  + healthy  -> probe,  -1      half-open: try one level lower
    probe   + trip     -> steady, +1      the probe failed: back up, and the dwell doubles (backoff)
    probe   + healthy  -> steady,  0      after ``probe_s`` of health: the lower level is committed

A failed probe goes back at once (it is the half-open circuit re-opening, not a new decision).

**Trip** when any of these holds (Google SRE workbook's multiwindow, multi-burn-rate alerts; burn rate
``b = bad_ratio / (1 - slo_target)``)::

    b(1 h) >= 14.4 and b(5 m) >= 14.4        fast burn: 2% of a 30-day budget in an hour
    b(6 h) >= 6    and b(30 m) >= 6          slow burn: 5% of the budget in six hours
    (both only while b(last 2 m) >= 1: a burn that has stopped does not escalate further, and only
    once the breaker has watched for the short window, 5 m and 30 m: see "A new sidecar" below)
    5xx ratio over 1 m >= error_max          an error storm (the last minute's answers, in 10 s buckets)
    preemptions/s >= preempt_max             KV thrash / OOM storm (the rate smoothed over ``preempt_tau_s``:
                                             a storm, not a burst of a few in one tick)
    memory used / total >= memory_max        an OOM is coming (a leak)

**A few bad answers are no storm.** Each trip on answers also needs ``min_bad`` (5) bad ones in its
short window: 5xx in the last minute, SLO-bad answers in the last 5 m (fast burn) or 30 m (slow burn).
At night's traffic one failed answer of six is a 17% share, over the fast burn's 14.4%; a 5xx among the
5 answers of one tick was a 20% "storm" (the ratio was the tick's until 2026-12-06). Either took the
breaker to L1, and the batch to half, for a dwell at least. A real fault brings many more: a 5xx storm at
10 answers/s with 30% failing has 180 in a minute.

**A new sidecar's long windows are short.** A new pod (a scale-out at the peak) has seen minutes of
answers: its 1 h and 6 h are those minutes, and each pair of windows is one short window, which the
workbook rejects as too quick to fire. So a pair trips only once the breaker has watched for its short
window (its oldest minute bucket is ``FAST_SPAN_S`` or ``SLOW_SPAN_S`` old; the state a restart restores
counts, so a restart waits for nothing). On the Mooncake hour (bench/classes.py) a slow burn of 11.8x
over 3.4 minutes took the breaker to L1 202 s in; a sidecar with six hours behind it would have counted
those minutes as 0.9% of them. The 5xx, preemption and memory trips do not wait.

**Queueing at full capacity is not a fault.** With ``itl_slo_s`` set, a burn does not trip while
decoding meets the inter-token SLO (window mean ITL <= ``itl_slo_s``) and the 5xx share is under
``error_max``: then the misses are late first tokens, requests that waited for a busy engine (in the
queue or behind other prompts' prefill, also while a queue drains), and every level makes that worse:
L1 halves the batch (less capacity, a longer queue), L2's fp8 weight-only kernels prefill slower on an
A100. The batch and token budget controllers own that case. Nor while the steps are prefill-bound: under
5% of a step's tokens are decodes (``policies/steps.py``), so the inter-token misses are prompt chunks
stalling decodes, which L1 cannot shorten and L2 lengthens on an A100; on the Azure 2024 coding week's
weekday peak the breaker went to L3 that way and the queue grew from ~150 to 7,000 requests. Only a
smaller token budget helps there. Faults still trip: a latency spike slows decode past the SLO, a 5xx
storm and a leak have their own trips, and so does a preemption storm.

**Healthy** when none holds and ``b(5 m) < 1`` (within budget), or when the burn goes on with misses no
level relieves (the two cases above): a level above L0 then only costs capacity, and its own cut lengthens
the queue the misses come from, so the budget never heals while it holds. On the Mooncake hour with
served_classes steering (bench/classes.py) a slow burn 202 s in took the breaker to L1; the halved batch
brought ITL under the SLO, requests went on being turned away from the queue, and L1 held for the other
57 minutes (42.93% of requests in SLO; 57.78% with this rule; no trip and 59.92% since a new sidecar
waits, above). The half-open probe still guards the step down: a lower level whose ITL breaks the SLO
again trips back up, with the dwell doubled.

Short windows only count outcomes of the current *generation* (since the last level change), so stale
outcomes from before a change never push the breaker further: each change bumps ``generation``. An
operator can force a level (``force``), which freezes the machine until ``release``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import NamedTuple

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import PRIORITY
from policies.base import Proposal
from policies.steps import TokenMix
from policies.windows import Buckets, rolling_sum, smoothed, window_totals

LEVELS = ("L0 normal", "L1 smaller batch", "L2 fp8 upstream", "L3 small model")
#: The upstream each level routes to. At L0 and L1 that is the breaker's ``normal_route``: ``primary``, or
#: ``default`` (the configured split) where the gate splits traffic across replicas.
UPSTREAM_BY_LEVEL = ("primary", "primary", "fp8", "small")
BUCKET_S = 60.0
#: How long the breaker must have watched before the fast (slow) burn may trip: the pair's short window.
FAST_SPAN_S, SLOW_SPAN_S = 300.0, 1800.0
#: The 5xx ratio's window, in buckets of ``ERROR_BUCKET_S``.
ERROR_WINDOW_S, ERROR_BUCKET_S = 60.0, 10.0

#: The transition table: (phase, event) -> (next phase, level step, action name).
TRANSITIONS: Mapping[tuple[str, str], tuple[str, int, str]] = MappingProxyType(
    {
        ("steady", "trip"): ("steady", +1, "escalate"),
        ("steady", "healthy"): ("probe", -1, "half-open probe"),
        ("probe", "trip"): ("steady", +1, "probe failed"),
        ("probe", "healthy"): ("steady", 0, "probe passed"),
    }
)


class Burns(NamedTuple):
    """Burn rates (bad share over the SLO's allowance) and the bad answers of the short windows."""

    b2: float
    b5: float
    b30: float
    b1h: float
    bad_5m: float
    bad_30m: float


@dataclass(frozen=True)
class BreakerState:
    level: int = 0
    phase: str = "steady"
    generation: int = 0
    changed_at: float = -1e18
    dwell_s: float = 0.0
    batch_cap: float | None = None
    buckets: Buckets = ()
    #: Answers without and with a 5xx, in ``ERROR_BUCKET_S`` buckets over the last ``ERROR_WINDOW_S``.
    answers: Buckets = ()
    forced: int | None = None
    reason: str = "normal"
    #: Preemptions/s smoothed over ``preempt_tau_s`` and when it was last updated.
    preempt_rate: float = 0.0
    at: float | None = None
    #: The engine's prompt and generated tokens/s, smoothed: are the steps prefill-bound?
    mix: TokenMix = field(default_factory=TokenMix)


@dataclass(frozen=True)
class Breaker:
    """The breaker policy. ``dwell_s``: least time between level changes; ``probe_s``: half-open trial."""

    slo_target: float = 0.99
    dwell_s: float = 300.0
    max_dwell_s: float = 3600.0
    probe_s: float = 120.0
    error_max: float = 0.05
    min_bad: float = 5.0
    preempt_max: float = 5.0
    preempt_tau_s: float = 60.0
    memory_max: float = 0.97
    batch_factor: float = 0.5
    batch_floor: float = 8.0
    #: The levels this deployment has: L2 needs an ``fp8`` upstream and L3 a ``small`` one. The breaker
    #: moves between neighbours in this tuple, so a gate with ``primary`` and ``small`` alone goes L1 -> L3,
    #: and one with ``primary`` alone stops at L1 instead of routing to an upstream that does not exist.
    levels: tuple[int, ...] = (0, 1, 2, 3)
    #: The inter-token SLO: with it, a burn while queueing at full capacity does not trip (see above).
    itl_slo_s: float | None = None
    #: Where L0 and L1 route: ``primary``, or ``default`` (``knobs.DEFAULT_ROUTE``: the gate's configured
    #: split) when the gate spreads traffic over several replicas, which forcing ``primary`` would undo.
    normal_route: str = "primary"
    name: str = "breaker"

    def __post_init__(self) -> None:
        if not 0.0 < self.slo_target < 1.0:
            raise ValueError(f"slo_target must be in (0, 1), got {self.slo_target}")
        if not self.levels or self.levels[0] != 0 or list(self.levels) != sorted(set(self.levels)):
            raise ValueError(f"levels must start at 0 and rise, got {self.levels}")
        if self.levels[-1] >= len(LEVELS):
            raise ValueError(f"levels go up to {len(LEVELS) - 1}, got {self.levels}")

    @property
    def max_level(self) -> int:
        return self.levels[-1]

    def _neighbour(self, level: int, step: int) -> int:
        """The next usable level up (``step`` > 0) or down (< 0) from ``level``; ``level`` at either end."""
        if step > 0:
            return next((n for n in self.levels if n > level), level)
        if step < 0:
            return next((n for n in reversed(self.levels) if n < level), level)
        return level

    # -- operator overrides -------------------------------------------------------------------------
    def force(self, state: BreakerState | None, level: int, now: float) -> BreakerState:
        """Pin ``level`` (one of ``levels``) until :meth:`release`; the change starts a new generation."""
        if level not in self.levels:
            usable = ", ".join(map(str, self.levels))
            raise ValueError(
                f"breaker level must be one of {usable} (the upstreams this gate has), got {level}"
            )
        state = state or BreakerState(dwell_s=self.dwell_s)
        return replace(
            state,
            level=level,
            phase="steady",
            forced=level,
            generation=state.generation + 1,
            changed_at=now,
            batch_cap=None if level == 0 else state.batch_cap,  # set on the next decide from the limit
            reason=f"forced to {LEVELS[level]} by the operator",
        )

    def release(self, state: BreakerState, now: float) -> BreakerState:
        """Hand control back to the automatic transitions (the level stays until they move it)."""
        return replace(state, forced=None, changed_at=now, reason="released by the operator")

    # -- signals ------------------------------------------------------------------------------------
    def _burns(self, state: BreakerState, now: float) -> Burns:
        """Burn rates over 2 m, 5 m and 30 m of the current generation and over 1 h overall, and the bad
        answers in the 5 m and 30 m windows. One pass over the last hour of minute buckets, newest first:
        this runs every tick, so it stays cheap."""
        key_now = int(now // BUCKET_S)
        since = int(state.changed_at // BUCKET_S) if state.changed_at > -1e17 else -(1 << 62)
        s = [0.0] * 8
        for key, good, bad in reversed(state.buckets[-60:]):
            age = key_now - key
            if age >= 60:
                break
            s[6] += good
            s[7] += bad
            if key >= since and age < 30:
                s[4] += good
                s[5] += bad
                if age < 5:
                    s[2] += good
                    s[3] += bad
                    if age < 2:
                        s[0] += good
                        s[1] += bad
        rates = (
            self._rate(s[0], s[1]),
            self._rate(s[2], s[3]),
            self._rate(s[4], s[5]),
            self._rate(s[6], s[7]),
        )
        return Burns(*rates, bad_5m=s[3], bad_30m=s[5])

    def _rate(self, good: float, bad: float) -> float:
        total = good + bad
        return (bad / total) / (1.0 - self.slo_target) if total > 0 else 0.0

    def _burn_6h(self, state: BreakerState) -> float:
        return self._rate(sum(b[1] for b in state.buckets), sum(b[2] for b in state.buckets))

    def _errors(self, state: BreakerState, now: float) -> tuple[float, float]:
        """The last minute's answers and their 5xx."""
        ok, errors = window_totals(state.answers, now, ERROR_BUCKET_S, ERROR_WINDOW_S)
        return ok + errors, errors

    def _storm(self, state: BreakerState, now: float) -> float | None:
        """The last minute's 5xx share when it is a storm (at least ``min_bad`` of them, ``error_max``)."""
        answers, errors = self._errors(state, now)
        share = errors / answers if answers else 0.0
        return share if errors >= self.min_bad and share >= self.error_max else None

    def _trip(
        self,
        snapshot: Snapshot,
        state: BreakerState,
        burns: Burns,
        now: float,
        storm: float | None,
        relieves_nothing: bool,
    ) -> str | None:
        # Burning still, in the last two minutes: a burn that stopped must not push the level further;
        # and not one no level relieves (queueing at full capacity, prefill-bound steps).
        burning = burns.b2 >= 1.0 and not relieves_nothing
        b5, b30, b1h = burns.b5, burns.b30, burns.b1h
        seen = now - state.buckets[0][0] * BUCKET_S if state.buckets else 0.0  # a new sidecar: see above
        if burning and seen >= FAST_SPAN_S and b1h >= 14.4 and b5 >= 14.4 and burns.bad_5m >= self.min_bad:
            return f"fast burn: {b5:.1f}x over 5 m and {b1h:.1f}x over 1 h (>= 14.4x)"
        if (
            burning
            and seen >= SLOW_SPAN_S
            and b30 >= 6.0
            and burns.bad_30m >= self.min_bad
            and (b6h := self._burn_6h(state)) >= 6.0
        ):
            return f"slow burn: {b30:.1f}x over 30 m and {b6h:.1f}x over 6 h (>= 6x)"
        if storm is not None:
            return f"5xx storm: {storm:.0%} of the last minute's answers (>= {self.error_max:.0%})"
        if state.preempt_rate >= self.preempt_max:
            return (
                f"preemption storm: {state.preempt_rate:.1f}/s over {self.preempt_tau_s:g} s "
                f"(>= {self.preempt_max:g}/s)"
            )
        used, total = snapshot.get(knobs.MEMORY_USED), snapshot.get(knobs.MEMORY_TOTAL)
        if used is not None and total and used / total >= self.memory_max:
            return f"memory {used / total:.1%} of the GPU (>= {self.memory_max:.0%}): OOM risk"
        return None

    def _no_level_helps(self, snapshot: Snapshot, state: BreakerState, storm: float | None) -> bool:
        """Errors are rare (no ``storm``) and the misses are ones no level relieves: decode meets the ITL
        SLO (first tokens that waited for a busy engine), or the steps are the prompt chunks'
        (policies/steps.py)."""
        if self.itl_slo_s is None or storm is not None:
            return False
        itl = snapshot.get(knobs.ITL_MEAN)
        return (itl is not None and itl <= self.itl_slo_s) or state.mix.prefill_bound()

    # -- the policy ---------------------------------------------------------------------------------
    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: BreakerState | None, now: float
    ) -> tuple[BreakerState, list[Proposal]]:
        state = state or BreakerState(dwell_s=self.dwell_s)
        if state.level not in self.levels:  # restored from a deployment with more upstreams than this one
            state = replace(
                state,
                level=self._neighbour(state.level, -1),
                forced=None,
                generation=state.generation + 1,
                changed_at=now,  # a level change like any other: the dwell starts here
                reason=f"L{state.level} is not available here (no upstream for it)",
            )
        requests = snapshot.get(knobs.GATE_REQUESTS) or 0.0
        bad = min(requests, snapshot.get(knobs.GATE_SLO_BAD) or 0.0)
        errors = min(requests, snapshot.get(knobs.GATE_ERRORS) or 0.0)
        preempt = snapshot.get(knobs.PREEMPTIONS) or 0.0
        state = replace(
            state,
            buckets=rolling_sum(state.buckets, now, BUCKET_S, 6 * 3600.0, requests - bad, bad),
            answers=rolling_sum(
                state.answers, now, ERROR_BUCKET_S, ERROR_WINDOW_S, requests - errors, errors
            ),
            preempt_rate=smoothed(state.preempt_rate, state.at, now, preempt, self.preempt_tau_s),
            at=now,
            mix=state.mix.update(snapshot, now),
        )
        if state.forced is None:
            state = self._step(snapshot, state, now)
        elif state.level >= 1 and state.batch_cap is None:
            # forced up from L0: the batch is cut as a trip cuts it (half the limit), not to the floor
            state = replace(state, batch_cap=self._first_cap(snapshot))
        return state, self._proposals(snapshot, state)

    def _first_cap(self, snapshot: Snapshot) -> float:
        """The batch cap on leaving L0: ``batch_factor`` of the limit in force, at least the floor, and
        never above that limit. A limit already under the floor (``policies.batch_min`` 4, the auto
        controller at 4) stays where it is: the floor alone raised it to 8, so the "smaller batch" level
        doubled the batch of an engine missing its SLO (seen in a closed-loop run, 2026-12-04)."""
        limit = snapshot.get(knobs.GATE_LIMIT) or self.batch_floor * 4
        return min(limit, max(self.batch_floor, limit * self.batch_factor))

    def _step(self, snapshot: Snapshot, state: BreakerState, now: float) -> BreakerState:
        burns = self._burns(state, now)
        storm = self._storm(state, now)
        relieves_nothing = self._no_level_helps(snapshot, state, storm)
        why = self._trip(snapshot, state, burns, now, storm, relieves_nothing)
        if why is not None:
            event = "trip"
        elif burns.b5 < 1.0:
            event = "healthy"
        elif relieves_nothing:
            # burning still, on misses no level relieves: a level above L0 only costs capacity (see above)
            event, why = "healthy", "the misses are ones no level relieves (the queue's, the prompt chunks')"
        else:
            return state
        if state.phase == "steady" and (
            (event == "healthy" and state.level == 0) or (event == "trip" and state.level >= self.max_level)
        ):
            return state  # nothing below L0, nothing above the top level
        phase, step, action = TRANSITIONS[(state.phase, event)]
        elapsed = now - state.changed_at
        dwell = state.dwell_s
        if state.phase == "probe":
            if event == "healthy" and elapsed < self.probe_s:
                return state
            if event == "trip":
                dwell = min(self.max_dwell_s, dwell * 2)  # back off: the next probe waits longer
            if event == "healthy":
                dwell = self.dwell_s
        elif elapsed < dwell:
            return state
        level = self._neighbour(state.level, step)
        if level == state.level and phase == state.phase:
            return state
        cap = state.batch_cap
        if level >= 1 and state.level == 0:
            cap = self._first_cap(snapshot)
        if level == 0:
            cap = None
        reason = f"{action}: {why}" if why else f"{action}: within the error budget"
        generation = state.generation + (1 if level != state.level else 0)
        return replace(
            state,
            level=level,
            phase=phase,
            generation=generation,
            changed_at=now if level != state.level else state.changed_at,
            dwell_s=dwell,
            batch_cap=cap,
            reason=reason,
        )

    def _proposals(self, snapshot: Snapshot, state: BreakerState) -> list[Proposal]:
        priority = PRIORITY["breaker"]
        why = f"{LEVELS[state.level]} (gen {state.generation}): {state.reason}"
        # a deployment with nothing to route to (no fp8 or small upstream, or no gate at all) gets no route
        # proposals: without a gate the knob is unbound, and each tick's proposal was audited as an error
        out: list[Proposal] = []
        if self.max_level >= 2:
            # L2/L3 route with the breaker's authority. L0/L1 only give routing back, at the lowest class:
            # a precision canary's fp8 share (route.fp8_share, the same split) wins over it (arbiter LINKED)
            if state.level >= 2:
                out.append(Proposal(self.name, knobs.UPSTREAM, UPSTREAM_BY_LEVEL[state.level], why, priority))
            else:
                out.append(
                    Proposal(self.name, knobs.UPSTREAM, self.normal_route, why, PRIORITY["throughput"])
                )
        if state.level >= 1:
            cap = state.batch_cap or self.batch_floor
            out.append(Proposal(self.name, knobs.BATCH, round(cap), why, priority))
        return out
