r"""Speculative decoding: acceptance against its own baseline, and whether speculation still pays.

Inputs (flat engine signals from the metric table, ``agent/collectors/metric_names.yaml``):

* vLLM: ``engine.spec_drafts_per_second``, ``engine.spec_draft_tokens_per_second`` and
  ``engine.spec_accepted_tokens_per_second`` (rates of ``vllm:spec_decode_num_{drafts,draft_tokens,
  accepted_tokens}_total``), and ``engine.spec_acceptance_ratio`` = accepted / draft tokens;
* llama.cpp: the same three rates and ratio, from ``llamacpp:spec_decode_num_*_total`` (counted as vLLM
  counts them: ``drafts`` are verification steps);
* SGLang: ``engine.spec_acceptance_ratio`` (``sglang:spec_accept_rate``) and
  ``engine.spec_accept_length`` (``sglang:spec_accept_length``, tokens per verify step).

**Drop against baseline.** The baseline :math:`b` of the acceptance ratio :math:`a` is the median of the
first ``warmup`` ticks with drafting, then an EWMA :math:`b \leftarrow b + w (a - b)` with
:math:`w = 1 - 2^{-\Delta t / h}` (half-life ``half_life_s``), learned only on ticks that are not hits, so
a lasting drop is not adopted as normal. A tick is a hit when :math:`a < (1 - \text{drop}) b`; ``k`` of
``n`` hits raise a warning.

**Does it still pay?** With ``K`` draft tokens per step and per-token acceptance :math:`a`, the target
model verifies and emits :math:`E = (1 - a^{K+1}) / (1 - a)` tokens per step on average (Leviathan et
al., 2023), measured directly where the engine reports it (vLLM: :math:`1 + \text{accepted}/\text{drafts}`;
SGLang: the accept length). One step costs :math:`1 + K c` target-forward equivalents, ``c`` being the
draft's cost relative to the target (``draft_cost_ratio``), so the expected speedup is
:math:`S = E / (1 + K c)`. When :math:`S < 1` for ``k`` of ``n`` ticks the finding is critical:
speculation now costs more than it saves.

**Which draft length pays best?** vLLM also counts the accepted tokens per draft position
(``engine.spec_accepted_by_position_per_second.position<j>``). Acceptance is a prefix: position ``j`` is
accepted only when every earlier one was, so :math:`p_j` = accepted at ``j`` / drafts is the share of
drafts with ``j + 1`` tokens or more accepted, and cutting the draft to :math:`K'` tokens keeps those
of the positions before :math:`K'` unchanged. The speedup a draft of :math:`K'` tokens would give is then
measured, not modelled:

.. math:: S(K') = \frac{1 + \sum_{j<K'} p_j}{1 + c \min(K', L)}

with :math:`L` the mean draft length now (a lookup may draft fewer than ``K`` tokens; :math:`\min(K', L)`
is at least the mean of the cut drafts, so a shorter draft is never made to look cheaper than it is).
Rates are smoothed with a half-life of ``length_half_life_s``. When a shorter draft :math:`1 \le K' < K`
gives at least ``length_gain`` (3%) more than the current one for ``k`` of ``n`` ticks, an ``info``
finding advises it ("drafts of 2 tokens instead of 3 would raise the expected speedup from 1.38x to
1.46x (token 3 of a draft is accepted in 5% of drafts)"); :math:`K' = 0` is the critical finding
above. A longer draft cannot be judged from these counters (positions past ``K`` are not drafted), so
it is never advised.
"""

from __future__ import annotations

import math
import statistics
from functools import partial

from detectors.base import Finding, Severity
from detectors.domain_util import KOfN, LastHit
from detectors.snapshot import Snapshot


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def expected_tokens_per_step(acceptance: float, draft_tokens: float) -> float:
    """:math:`E = (1 - a^{K+1}) / (1 - a)`, the mean tokens one verify step emits; ``K + 1`` at a = 1."""
    a = min(1.0, max(0.0, acceptance))
    if a >= 1.0:
        return draft_tokens + 1.0
    return float((1.0 - a ** (draft_tokens + 1.0)) / (1.0 - a))


POSITION_PREFIX = "engine.spec_accepted_by_position_per_second.position"


def speedup_by_draft_length(
    accepted_share: list[float], mean_draft_tokens: float, draft_cost_ratio: float
) -> list[float]:
    """:math:`S(K')` for :math:`K' = 0 .. K` (module docstring): ``accepted_share[j]`` is the share of
    drafts whose token ``j`` was accepted, ``mean_draft_tokens`` the mean tokens drafted per draft."""
    speedups = [1.0]
    tokens = 1.0
    for length, share in enumerate(accepted_share, start=1):
        tokens += max(0.0, share)
        speedups.append(tokens / (1.0 + draft_cost_ratio * min(float(length), mean_draft_tokens)))
    return speedups


class SpecDecodeDetector:
    """Flags a drop in speculative-decoding acceptance and a speedup that fell below 1."""

    name = "spec_decode"

    def __init__(
        self,
        drop: float = 0.25,
        draft_cost_ratio: float = 0.1,
        half_life_s: float = 3600.0,
        warmup: int = 30,
        k: int = 3,
        n: int = 5,
        length_half_life_s: float = 300.0,
        length_gain: float = 0.03,
    ) -> None:
        self.drop = drop
        self.draft_cost_ratio = draft_cost_ratio
        self.half_life_s = half_life_s
        self.warmup = warmup
        self.k = k
        self.n = n
        self.baseline_: float | None = None
        self.warm_: list[float] = []
        self.t_: float = -math.inf
        self.drop_gate_ = KOfN(k, n)
        self.pay_gate_ = KOfN(k, n)
        self.drop_shown_ = LastHit()
        self.pay_shown_ = LastHit()
        self.length_half_life_s = length_half_life_s
        self.length_gain = length_gain
        #: smoothed rates: drafts, draft tokens, then accepted tokens by position (``_by_length``)
        self.rates_: list[float] = []
        self.rates_t_: float = -math.inf
        self.length_gate_ = KOfN(k, n)
        self.length_shown_ = LastHit()

    def _observe(self, snapshot: Snapshot) -> tuple[float, float, float] | None:
        """(acceptance ratio, tokens per step E, draft tokens per step K) this tick, or None."""
        get = snapshot.get
        ratio = _finite(get("engine.spec_acceptance_ratio"))
        drafts = _finite(get("engine.spec_drafts_per_second"))
        draft_tokens = _finite(get("engine.spec_draft_tokens_per_second"))
        accepted = _finite(get("engine.spec_accepted_tokens_per_second"))
        length = _finite(get("engine.spec_accept_length"))
        if drafts is not None and draft_tokens is not None and accepted is not None:  # vLLM counters
            if drafts <= 0 or draft_tokens <= 0:
                return None  # nothing drafted this tick (idle): no evidence either way
            k_tokens = draft_tokens / drafts
            return accepted / draft_tokens, 1.0 + accepted / drafts, k_tokens
        if ratio is not None and length is not None and ratio > 0 and length >= 1:  # SGLang gauges
            return ratio, length, max(1.0, (length - 1.0) / ratio)
        return None

    def update(self, snapshot: Snapshot) -> list[Finding]:
        """Score acceptance against the baseline and the speedup against 1, then learn."""
        seen = self._observe(snapshot)
        if seen is None:
            return []
        ratio, per_step, k_tokens = seen
        now = snapshot.now
        if self.baseline_ is None:
            self.warm_.append(ratio)
            if len(self.warm_) >= self.warmup:
                self.baseline_ = statistics.median(self.warm_)
                self.t_ = now
            return []
        baseline = self.baseline_
        hit = ratio < (1.0 - self.drop) * baseline
        speedup = per_step / (1.0 + k_tokens * self.draft_cost_ratio)
        paying_hit = speedup < 1.0
        dropping = self.drop_gate_.push(hit, now)
        not_paying = self.pay_gate_.push(paying_hit, now)
        if not hit and now > self.t_:
            w = 1.0 - 2.0 ** (-(now - self.t_) / self.half_life_s)
            self.baseline_ = baseline + w * (ratio - baseline)
        self.t_ = max(self.t_, now)
        advice = self._by_length(snapshot)
        evidence: dict[str, float | str] = {
            "acceptance_ratio": ratio,
            "baseline": baseline,
            "tokens_per_step": per_step,
            "draft_tokens_per_step": k_tokens,
            "expected_speedup": speedup,
        }
        realised = _finite(snapshot.get("engine.decode_tokens_per_step"))
        if realised is not None:  # over every decode step, those a lookup found nothing to draft for too
            evidence["decode_tokens_per_step"] = realised
        measured = f"acceptance {ratio:.2f}, expected speedup {speedup:.2f}x"
        # each gate's last hit kept current, the critical finding reported when both stand
        shown: list[Finding] = []
        for active, gate, last, gate_hit, build in (
            (not_paying, self.pay_gate_, self.pay_shown_, paying_hit, self._not_paying),
            (dropping, self.drop_gate_, self.drop_shown_, hit, self._dropping),
        ):
            if active:
                shown.append(last.show(gate, gate_hit, partial(build, now, evidence), measured))
            else:
                last.clear()
        return shown[:1] + advice

    def _positions(self, snapshot: Snapshot) -> list[float] | None:
        """Accepted tokens per second at positions 0, 1, ... (vLLM), or None without a complete run."""
        accepted: list[float] = []
        while (value := _finite(snapshot.get(f"{POSITION_PREFIX}{len(accepted)}"))) is not None:
            accepted.append(value)
        return accepted or None

    def _by_length(self, snapshot: Snapshot) -> list[Finding]:
        """The draft-length advice (module docstring) on a tick with drafting; [] while it does not pay
        to cut, or without per-position counters."""
        get = snapshot.get
        positions = self._positions(snapshot)
        drafts, draft_tokens = (
            _finite(get("engine.spec_drafts_per_second")),
            _finite(get("engine.spec_draft_tokens_per_second")),
        )
        if positions is None or not drafts or not draft_tokens:
            return []
        now, rates = snapshot.now, [drafts, draft_tokens, *positions]
        if len(rates) != len(self.rates_) or now <= self.rates_t_:
            self.rates_ = rates  # the first tick, or the draft length changed: start over
        else:
            w = 1.0 - 2.0 ** (-(now - self.rates_t_) / self.length_half_life_s)
            self.rates_ = [old + w * (new - old) for old, new in zip(self.rates_, rates, strict=True)]
        self.rates_t_ = now
        drafts, draft_tokens, *accepted = self.rates_
        speedups = speedup_by_draft_length(
            [a / drafts for a in accepted], draft_tokens / drafts, self.draft_cost_ratio
        )
        current = len(accepted)
        best = max(range(1, current + 1), key=lambda length: speedups[length])
        gain = speedups[best] / speedups[current] - 1.0
        # a cut that still does not pay is no advice: "turn it off" is the critical finding's
        hit = best < current and gain >= self.length_gain and speedups[best] > 1.0
        measured = f"{current} tokens {speedups[current]:.2f}x, {best} tokens {speedups[best]:.2f}x"
        if not self.length_gate_.push(hit, now):
            self.length_shown_.clear()
            return []
        evidence: dict[str, float | str] = {
            "draft_tokens": current,
            "best_draft_tokens": best,
            "expected_speedup": speedups[current],
            "best_expected_speedup": speedups[best],
            "mean_draft_tokens": draft_tokens / drafts,
            **{f"accepted_share_position{j}": a / drafts for j, a in enumerate(accepted)},
        }
        cut = accepted[best] / drafts if best < current else 0.0  # what a cut would lose (a held alarm: none)
        build = partial(self._shorter, now, evidence, cut)
        return [self.length_shown_.show(self.length_gate_, hit, build, measured)]

    def _not_paying(self, now: float, evidence: dict[str, float | str]) -> Finding:
        speedup, ratio = float(evidence["expected_speedup"]), float(evidence["acceptance_ratio"])
        per_step = float(evidence["tokens_per_step"])
        return Finding(
            self.name, "engine.spec_acceptance_ratio", Severity.CRITICAL,
            min(1.0, 1.0 - speedup + 0.5),
            f"speculative decoding no longer pays: expected speedup {speedup:.2f}x "
            f"(acceptance {ratio:.2f}, {per_step:.2f} tokens per step)",
            self.pay_gate_.since(now), evidence,
            "turn speculation off or shorten the draft (num_speculative_tokens); check whether the "
            "traffic mix changed away from what the draft model was trained on",
        )  # fmt: skip

    def _shorter(self, now: float, evidence: dict[str, float | str], first_cut: float) -> Finding:
        current, best = int(evidence["draft_tokens"]), int(evidence["best_draft_tokens"])
        speedup, better = float(evidence["expected_speedup"]), float(evidence["best_expected_speedup"])
        return Finding(
            self.name, "engine.spec_accepted_by_position_per_second", Severity.INFO,
            min(1.0, better / speedup - 1.0),
            f"drafts of {best} tokens instead of {current} would raise the expected speedup from "
            f"{speedup:.2f}x to {better:.2f}x (token {best + 1} of a draft is accepted in {first_cut:.0%} "
            f"of drafts)",
            self.length_gate_.since(now), evidence,
            f"set num_speculative_tokens to {best}; the draft cost ratio assumed is "
            f"{self.draft_cost_ratio:g} target forwards per draft token",
        )  # fmt: skip

    def _dropping(self, now: float, evidence: dict[str, float | str]) -> Finding:
        speedup, ratio = float(evidence["expected_speedup"]), float(evidence["acceptance_ratio"])
        baseline = float(evidence["baseline"])
        score = min(1.0, (baseline - ratio) / max(baseline, 1e-9) / max(self.drop, 1e-9) * 0.5)
        return Finding(
            self.name, "engine.spec_acceptance_ratio", Severity.WARNING, score,
            f"spec-decode acceptance {ratio:.2f} is {1 - ratio / baseline:.0%} below its "
            f"baseline {baseline:.2f} (expected speedup {speedup:.2f}x)",
            self.drop_gate_.since(now), evidence,
            "compare the traffic mix with the draft's training data; run servepilot specdec-eval "
            "on recent prompts",
        )  # fmt: skip
