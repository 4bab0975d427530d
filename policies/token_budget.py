"""The chunked-prefill token budget (``max_num_batched_tokens``): small chunks when prefill stalls decodes.

A step's duration grows with the prompt tokens it carries: on the simulated A100 with Llama-2-7B a step
with a 2048-token chunk takes ~0.13 s, over a 0.1 s inter-token SLO for every request decoding in it,
while a 512-token chunk takes ~0.03 s. Prefill throughput hardly depends on the chunk (15.8k tokens/s at
2048, 15.5k at 512, 14.5k at 256), so smaller chunks cap that stall at little cost. So::

    itl_hi = h * itl_slo                 (h: the same headroom as the batch controller)
    prefill = prompt_tps > 0             (this tick's steps computed prompt tokens: a prefix cache's
                                          hits are none, policies/steps.py)
    ttft_risk = ttft_p99 > h * ttft_slo or queue / finish_rate > 0.5 * ttft_slo   (no finishes: p99 only)
    kv_pressure = preemptions > 0 or kv_usage > kv_high
    pressed = a kv_pressure tick within the last kv_hold_s

    since the last change < dwell_s                  ->  hold (the ITL window still holds old steps)
    kv_pressure and prefill and B > kv_floor         ->  B = B / 2      KV-bound: shorter steps serve the
                                                                        same tokens with fewer resident
    itl_p99 > itl_hi and prefill                     ->  B = B / 2      chunks stall decodes: shrink
    itl_p99 < low * itl_slo and ttft_risk
      and not pressed and kv_usage < kv_target       ->  B = B * 2      prefill is the bottleneck and
                                                                        ITL has room for bigger chunks
    otherwise                                        ->  hold
    B = min(upper, max(lower, B))

KV pressure: a request's decode speed is one token per step, so at a given token rate the number of
sequences resident in the KV cache is proportional to the step time. When the cache is what limits (a
chat trace with long histories near capacity: preemptions, usage near full), halving the chunk about
halves the prefill steps' time, and the same goodput needs fewer resident sequences; prefill throughput
hardly changes (15.5k tokens/s at 512 vs 15.9k at 1024 on the A100 profile). Measured: on the Azure
conversation trace at x1.2, ``max_num_seqs`` 96 thrashes (531 preemptions, 95% attainment) with a 1024
budget and serves 99.1% without a preemption with 512. Doubling back is barred for ``kv_hold_s`` after
the last pressure and while usage is above ``kv_target``, since the larger chunk brings the thrash back.

The floor (``lower``, 512 by default) is reached only under KV pressure: ITL alone stops halving at
``itl_floor`` (1024), where a full chunk's step is already well under the ITL target on the A100
profile (0.063 s): below it, a tail over target comes from decode (the batch limit's business) or from
rare long steps, and halving again only loses prefill throughput. That premise holds at full clock
only: with the energy policy in the set (it lowers the SM clock), a 1024-token step is that much
longer, so :func:`policies.registry.build_set` sets ``itl_floor`` to ``lower`` there. It holds for an
ITL target of 0.1 s (:data:`FLOOR_ITL_S`) only, too: a step's time grows with its chunk, so the floor
scales with the target (0.05 s, an interactive class steered to, ``policies.itl_steering``: 512, where
a full chunk's step takes ~0.03 s). Found by replaying priority classes: steered to 0.05 s, the budget
stopped at 1024, whose 0.063 s steps alone broke the target, and the batch controller cut the batch
instead (to ~60), which cannot shorten a prefill step and only queued requests.

The gap between ``itl_hi`` and ``low * itl_slo`` is the hysteresis: doubling a budget about doubles its
stall, so a budget is raised only when twice its ITL still meets the target. The ITL signal is the
window's p99 (not the mean the batch controller reads): a few long steps among many short decode steps
barely move the mean but break the SLO of every request decoding through them. The current budget is
read from the engine's signal (``engine.max_num_batched_tokens``) when published, else the state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from detectors.base import Finding
from detectors.snapshot import Snapshot
from policies import knobs
from policies.arbiter import PRIORITY
from policies.base import Proposal
from policies.steps import computed_prompt_tps

#: The ITL target at which ``itl_floor`` was measured to leave a full chunk's step well inside it.
FLOOR_ITL_S = 0.1


@dataclass(frozen=True)
class BudgetState:
    budget: float
    changed_at: float | None = None
    #: When the KV cache was last under pressure (preemptions or usage above ``kv_high``).
    pressed_at: float | None = None


@dataclass(frozen=True)
class TokenBudget:
    """The token-budget controller (see module docstring for the rule)."""

    ttft_slo_s: float
    itl_slo_s: float
    lower: float = 512.0
    upper: float = 4096.0
    initial: float = 2048.0
    headroom: float = 0.8
    low: float = 0.4
    dwell_s: float = 10.0
    itl_floor: float = 1024.0
    kv_high: float = 0.95
    kv_target: float = 0.85
    kv_hold_s: float = 60.0
    name: str = "token_budget"

    def __post_init__(self) -> None:
        if not (self.ttft_slo_s > 0 and self.itl_slo_s > 0):
            raise ValueError("SLO targets must be > 0")
        if not 0 < self.lower <= self.initial <= self.upper:
            raise ValueError("bounds must satisfy 0 < lower <= initial <= upper")
        if not 0 < self.low < self.headroom:
            raise ValueError("need 0 < low < headroom (the hysteresis band)")
        if not 0 < self.kv_target <= self.kv_high:
            raise ValueError("need 0 < kv_target <= kv_high")

    @property
    def floor_for_itl(self) -> float:
        """How far ITL alone may halve the budget: ``itl_floor`` scaled by the ITL target over
        :data:`FLOOR_ITL_S` (never above ``itl_floor``, never below ``lower``)."""
        return max(self.lower, min(self.itl_floor, self.itl_floor * self.itl_slo_s / FLOOR_ITL_S))

    def decide(
        self, snapshot: Snapshot, findings: Sequence[Finding], state: BudgetState | None, now: float
    ) -> tuple[BudgetState | None, list[Proposal]]:
        itl = snapshot.get(knobs.ITL_P99)
        if snapshot.get(knobs.RUNNING) is None or itl is None:
            return state, []  # no engine data or no tokens in the window: nothing to judge
        published = snapshot.get(knobs.TOKEN_BUDGET)
        budget = published if published is not None else (state.budget if state else self.initial)
        changed_at = state.changed_at if state else None
        kv = snapshot.get(knobs.KV_USAGE) or 0.0
        preempt = snapshot.get(knobs.PREEMPTIONS) or 0.0
        kv_pressure = preempt > 0 or kv > self.kv_high
        pressed_at = now if kv_pressure else (state.pressed_at if state else None)
        if changed_at is not None and now - changed_at < self.dwell_s:
            return BudgetState(budget, changed_at, pressed_at), []
        prompt_tps = computed_prompt_tps(snapshot)
        waiting = (snapshot.get(knobs.WAITING) or 0.0) + (snapshot.get(knobs.GATE_QUEUE) or 0.0)
        finished = snapshot.get(knobs.FINISHED) or 0.0
        # Little's law needs a finish rate: a request or two queued in a tick where none finished is
        # the normal gap between arrivals of long prompts, not a TTFT risk (TTFT p99 covers a stall)
        wait = waiting / finished if finished > 0 else 0.0
        ttft = snapshot.get(knobs.TTFT_P99) or 0.0
        ttft_risk = ttft > self.headroom * self.ttft_slo_s or wait > 0.5 * self.ttft_slo_s
        itl_hi = self.headroom * self.itl_slo_s
        pressed = pressed_at is not None and now - pressed_at < self.kv_hold_s
        if kv_pressure and prompt_tps > 0 and budget > self.lower:
            new = budget / 2
            why = f"KV cache under pressure (usage {kv:.0%}, {preempt:.2g} preemptions/s) while prefilling"
        elif itl > itl_hi and prompt_tps > 0 and budget > max(self.lower, self.floor_for_itl):
            new = max(budget / 2, self.floor_for_itl)
            # 4 significant digits: just over the target must not read "0.080s above 0.080s"
            why = f"ITL p99 {itl:.4g}s above {itl_hi:.4g}s while prefilling {prompt_tps:.0f} tok/s"
        elif (
            itl < self.low * self.itl_slo_s
            and ttft_risk
            and not pressed
            and kv < self.kv_target
            and budget < self.upper
        ):
            new = budget * 2
            why = f"TTFT at risk (p99 {ttft:.2f}s, {waiting:.0f} queued) and ITL p99 {itl:.3f}s has room"
        else:
            return BudgetState(budget, changed_at, pressed_at), []
        new = min(self.upper, max(self.lower, new))
        proposal = Proposal(self.name, knobs.TOKEN_BUDGET, round(new), why, PRIORITY["throughput"])
        return BudgetState(new, now, pressed_at), [proposal]
