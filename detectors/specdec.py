r"""Speculative decoding: acceptance against its own baseline, and whether speculation still pays.

Inputs (flat engine signals from the metric table, ``agent/collectors/metric_names.yaml``):

* vLLM: ``engine.spec_drafts_per_second``, ``engine.spec_draft_tokens_per_second`` and
  ``engine.spec_accepted_tokens_per_second`` (rates of ``vllm:spec_decode_num_{drafts,draft_tokens,
  accepted_tokens}_total``), and ``engine.spec_acceptance_ratio`` = accepted / draft tokens;
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
        evidence: dict[str, float | str] = {
            "acceptance_ratio": ratio,
            "baseline": baseline,
            "tokens_per_step": per_step,
            "draft_tokens_per_step": k_tokens,
            "expected_speedup": speedup,
        }
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
        return shown[:1]

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
