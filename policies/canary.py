"""Precision canary: a perplexity gate, then a stepped fp8 rollout with automatic rollback.

The Flagger / Argo Rollouts pattern as a pure state machine. The agent measures perplexity on a
validation set through both upstreams' completions API (prompt logprobs) and feeds the two numbers in
(``canary.ppl_primary``, ``canary.ppl_fp8`` in the snapshot); the policy never does I/O::

    idle      --start-->               gate
    gate      ppl delta < max_delta -> step 0 (5 %)            delta = ppl_fp8 / ppl_primary - 1
              otherwise             -> rolled_back
              no PPL for gate_timeout_s -> rolled_back
    step k    healthy for step_s    -> step k+1 ... -> promoted (100 %)
              a failed check        -> failures + 1; > failure_limit -> rolled_back (0 %)
              missing metrics       -> counts as a failed check
              candidate down        -> counts as a failed check
              a step with no answer from the candidate where min_expected were due -> a failed check
    promoted / rolled_back: terminal (start again to retry)

A check runs every tick. It is healthy when the SLO-bad share and the 5xx share of the gate's answers
over the last ``window_s`` stay under their limits, and the candidate's own answers in this step do
too. Judged tick by tick, a quiet service failed checks on noise: at 3 answers a tick one slow answer
makes a tick 33 % SLO-bad (seen live), and with 2 % of answers slow, 6 % of such ticks have one, about
18 failed checks in a 300 s step: a healthy candidate could not finish a rollout. A share is judged
once ``min_bad`` answers are bad: 3 of 4 answers failing is evidence, 1 of 3 is not.

Judged on the gate's totals alone, a candidate at 5 % could miss the SLO on 30 % of its answers and move
the total by 1.5 points, under the 5 % limit: the canary exists to catch that at 5 %, not at 25 %. So,
over the step so far, the candidate fails a check when at least ``min_bad`` of its answers were 5xx (or
SLO-bad) and that share is over its limit *and* over the rest of the traffic's in the same step (a slow
period that hurts every upstream alike is not the candidate's fault).

Answers that have not come back count too. A request the candidate holds with no first token past the
TTFT SLO, or streaming too slowly to meet the ITL SLO whatever comes next
(``gate.upstream.<candidate>.late``, a level the gate reads each tick) will be an SLO-bad answer; the
check adds those to the step's answers and bad answers, for the candidate and for the rest alike
(``gate.late``). Counting only finished answers, a candidate too slow to finish any within a step
passed it (seen live: fp8 slowed 30x passed its 5% step and was rolled back only at 25%, on missing data).

The candidate's health check failing (``gate.upstream.<candidate>.up``) is a failed check, and so is a
step in which the candidate answered nothing (``gate.upstream.<candidate>.requests``) although its share
of the step's answers came to ``min_expected`` or more: seen live, a killed fp8 upstream rolled on to
100 % with every check "healthy", because the gate failed its requests over to the primary and the
checks read only the gate's totals. The policy proposes ``route.fp8_share`` at every tick, so a
rollback is level-based too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import PRIORITY
from policies.base import Proposal

PPL_PRIMARY = "canary.ppl_primary"
PPL_FP8 = "canary.ppl_fp8"


@dataclass(frozen=True)
class CanaryState:
    phase: str = "idle"
    step: int = 0
    entered_at: float = 0.0
    failures: int = 0
    reason: str = "not started"
    #: answers in this step: all of the gate's, and the candidate's own (the missing-data check)
    answered: float = 0.0
    served: float = 0.0
    #: this step's 5xx and SLO-bad answers: all of the gate's, and the candidate's own
    errors: float = 0.0
    bad: float = 0.0
    served_errors: float = 0.0
    served_bad: float = 0.0
    #: the gate's (time, answers, SLO-bad, 5xx) per tick over the last ``window_s``
    recent: tuple[tuple[float, float, float, float], ...] = ()


@dataclass(frozen=True)
class Canary:
    """The precision canary. ``steps`` are traffic shares to fp8; ``max_ppl_delta`` is relative."""

    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    max_ppl_delta: float = 0.005
    step_s: float = 300.0
    gate_timeout_s: float = 600.0
    failure_limit: int = 2
    max_bad_ratio: float = 0.05
    max_error_ratio: float = 0.01
    candidate: str = "fp8"
    min_expected: float = 10.0
    min_bad: float = 3.0
    window_s: float = 30.0
    name: str = "canary"

    def __post_init__(self) -> None:
        if (
            not self.steps
            or any(not 0 < s <= 1 for s in self.steps)
            or list(self.steps) != sorted(self.steps)
        ):
            raise ValueError("canary steps must be increasing shares in (0, 1]")

    def start(self, state: CanaryState | None, now: float) -> CanaryState:
        """Begin (or restart) a rollout: first the perplexity gate."""
        return CanaryState("gate", 0, now, 0, "measuring perplexity")

    def share(self, state: CanaryState) -> float:
        if state.phase == "rolling":
            return self.steps[state.step]
        return 1.0 if state.phase == "promoted" else 0.0

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: CanaryState | None, now: float
    ) -> tuple[CanaryState, list[Proposal]]:
        state = state or CanaryState()
        if state.phase == "gate":
            state = self._gate(snapshot, state, now)
        elif state.phase == "rolling":
            state = self._check(snapshot, state, now)
        if state.phase == "idle":
            return state, []
        share = self.share(state)
        return state, [Proposal(self.name, knobs.FP8_SHARE, share, state.reason, PRIORITY["slo_guard"])]

    def _gate(self, snapshot: Snapshot, state: CanaryState, now: float) -> CanaryState:
        primary, fp8 = snapshot.get(PPL_PRIMARY), snapshot.get(PPL_FP8)
        if primary is None or fp8 is None or primary <= 0:
            if now - state.entered_at >= self.gate_timeout_s:
                return replace(state, phase="rolled_back", reason="no perplexity within the gate timeout")
            return state
        delta = fp8 / primary - 1.0
        if delta >= self.max_ppl_delta:
            return replace(
                state,
                phase="rolled_back",
                reason=f"perplexity +{delta:.2%} >= {self.max_ppl_delta:.2%}: fp8 refused",
            )
        return CanaryState("rolling", 0, now, 0, f"perplexity +{delta:.2%}: fp8 at {self.steps[0]:.0%}")

    def _candidate_worse(self, state: CanaryState, late: float, late_all: float) -> str | None:
        """Why the candidate's own answers in this step fail it (see the module docstring), or None.
        ``late`` / ``late_all``: requests the candidate / every upstream holds now that are already late."""
        late_rest = max(late_all - late, 0.0)
        for what, mine, total, limit, pending, pending_rest in (
            ("5xx", state.served_errors, state.errors, self.max_error_ratio, 0.0, 0.0),
            ("SLO-bad", state.served_bad, state.bad, self.max_bad_ratio, late, late_rest),
        ):
            served = state.served + pending
            if served <= 0:
                continue
            rest = max(state.answered - state.served, 0.0) + pending_rest
            ratio = (mine + pending) / served
            others = (max(total - mine, 0.0) + pending_rest) / rest if rest > 0 else 0.0
            if mine + pending >= self.min_bad and ratio > limit and ratio > others:
                held = f", {pending:.0f} of them late and still held" if pending else ""
                return (
                    f"{self.candidate} {what} {ratio:.0%} of its {served:.0f} answers this step{held} "
                    f"(the rest {others:.0%})"
                )
        return None

    def _window_over(self, recent: tuple[tuple[float, float, float, float], ...]) -> str | None:
        """Why the gate's answers over the last ``window_s`` fail a check, or None (too few to judge)."""
        answered = sum(w[1] for w in recent)
        bad, errors = sum(w[2] for w in recent), sum(w[3] for w in recent)
        if (bad >= self.min_bad and bad / answered > self.max_bad_ratio) or (
            errors >= self.min_bad and errors / answered > self.max_error_ratio
        ):
            share = f"SLO-bad {bad / answered:.0%}, 5xx {errors / answered:.0%}"
            return f"{share} of {answered:.0f} answers in {self.window_s:g}s"
        return None

    def _check(self, snapshot: Snapshot, state: CanaryState, now: float) -> CanaryState:
        requests = snapshot.get(knobs.GATE_REQUESTS)
        bad = snapshot.get(knobs.GATE_SLO_BAD)
        errors = snapshot.get(knobs.GATE_ERRORS)
        up = snapshot.get(knobs.upstream_signal(self.candidate, "up"))
        served = snapshot.get(knobs.upstream_signal(self.candidate, "requests"))
        if requests is None or bad is None or errors is None:
            healthy, why = False, "metrics missing"
        elif up is not None and up <= 0:
            healthy, why = False, f"upstream {self.candidate} is down"
        else:
            healthy, why = True, ""
        share = self.steps[state.step]
        recent = tuple(w for w in state.recent if w[0] > now - self.window_s)
        if requests is not None and bad is not None and errors is not None:
            recent += ((now, requests, bad, errors),)
            if healthy and (over := self._window_over(recent)) is not None:
                healthy, why = False, over
        state = replace(
            state,
            recent=recent,
            answered=state.answered + (requests or 0.0),
            served=state.served + (served or 0.0),
            errors=state.errors + (errors or 0.0),
            bad=state.bad + (bad or 0.0),
            served_errors=state.served_errors
            + (snapshot.get(knobs.upstream_signal(self.candidate, "errors")) or 0.0),
            served_bad=state.served_bad
            + (snapshot.get(knobs.upstream_signal(self.candidate, "slo_bad")) or 0.0),
        )
        late = snapshot.get(knobs.upstream_signal(self.candidate, "late")) or 0.0
        late_all = max(snapshot.get(knobs.GATE_LATE) or 0.0, late)
        if healthy and (worse := self._candidate_worse(state, late, late_all)) is not None:
            healthy, why = False, worse
        done = now - state.entered_at >= self.step_s
        if (
            healthy
            and done
            and served is not None
            and state.served == 0
            and state.answered * share >= self.min_expected
        ):
            # a step with no answer from the candidate proves nothing: its weight did not reach the gate, or
            # the gate failed its requests over to the primary; a rollout must not promote on no data
            healthy = False
            why = f"missing data: {self.candidate} answered none of {state.answered:.0f} at {share:.0%}"
        if not healthy:
            failures = state.failures + 1
            if failures > self.failure_limit:
                return replace(
                    state,
                    phase="rolled_back",
                    failures=failures,
                    reason=f"rolled back at {share:.0%}: {why}",
                )
            return replace(
                state, failures=failures, reason=f"check failed ({failures}/{self.failure_limit}): {why}"
            )
        if not done:
            return state
        if state.step + 1 >= len(self.steps):
            return replace(state, phase="promoted", reason="fp8 promoted to 100%")
        step = state.step + 1
        return CanaryState(
            "rolling", step, now, 0, f"healthy for {self.step_s:g}s: fp8 at {self.steps[step]:.0%}"
        )
