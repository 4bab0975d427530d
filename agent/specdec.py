r"""Offline draft-vs-target comparison for speculative decoding, through the engines' logprobs.

Is a draft model worth deploying in front of a target? Speculative sampling accepts a drafted token
with probability :math:`\min(1, p(x)/q(x))`, so the expected per-token acceptance is
:math:`\alpha = \sum_x \min(p(x), q(x)) = 1 - \mathrm{TV}(p, q)` (Leviathan et al., 2023), and a step
with ``K`` drafted tokens emits :math:`(1-\alpha^{K+1})/(1-\alpha)` tokens. We call :math:`\alpha` the
distribution similarity; the rule of thumb is to deploy a draft when it exceeds 0.85.

Method (:func:`evaluate`): for each prompt the *target* generates greedily with ``logprobs = k``
(OpenAI completions API: top-``k`` logprobs per position); the *draft* then scores the same text under
teacher forcing (``echo: true``, so the prompt's logprobs come back), which gives both distributions at
the same prefixes. Both must share a tokenizer (speculative decoding requires it anyway); positions
whose tokens differ are skipped and counted.

Only the top ``k`` of each distribution is known. On the union ``U`` of both top-``k`` sets, a token
missing from one side gets that side's leftover mass split evenly with an "other" bucket, but never
more than its smallest listed probability. The reported :math:`\alpha = \sum_{x \in U} \min(p, q)` is then
a lower bound (the unseen tail can only add overlap); KL(p || q) is over ``U`` plus "other", and the
top-``k`` overlap is :math:`|\mathrm{top}_k(p) \cap \mathrm{top}_k(q)| / k`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

TopK = Mapping[str, float]  # token -> logprob
FLOOR = 1e-10


def _aligned(p: TopK, q: TopK) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities of ``p`` and ``q`` on the union of their top-k, plus an "other" bucket (last)."""
    support = sorted(set(p) | set(q))

    def fill(dist: TopK) -> np.ndarray:
        known = {t: math.exp(lp) for t, lp in dist.items() if math.isfinite(lp)}
        rest = max(0.0, 1.0 - sum(known.values()))
        missing = [t for t in support if t not in known]
        share = min(min(known.values(), default=rest), rest / (len(missing) + 1)) if missing else 0.0
        probs = np.array([known.get(t, share) for t in support] + [0.0], dtype=np.float64)
        probs[-1] = max(0.0, 1.0 - float(probs[:-1].sum()))
        normalised: np.ndarray = probs / probs.sum()
        return normalised

    return fill(p), fill(q)


def similarity(p: TopK, q: TopK) -> float:
    """Lower bound of :math:`\\alpha = \\sum_x \\min(p(x), q(x))` from two top-k logprob maps."""
    a, b = _aligned(p, q)
    return float(np.minimum(a[:-1], b[:-1]).sum())


def kl_divergence(p: TopK, q: TopK) -> float:
    """KL(p || q) in nats over the union of the top-k plus the "other" bucket."""
    a, b = _aligned(p, q)
    a, b = np.maximum(a, FLOOR), np.maximum(b, FLOOR)
    return float(np.sum(a * np.log(a / b)))


def topk_overlap(p: TopK, q: TopK) -> float:
    """Share of the target's top-k tokens that are also in the draft's top-k."""
    return len(set(p) & set(q)) / len(p) if p else 0.0


@dataclass(frozen=True)
class Verdict:
    """The comparison over a prompt set, and whether the draft is worth deploying."""

    prompts: int
    positions: int
    skipped_positions: int
    similarity: float
    kl_mean: float
    topk_overlap: float
    threshold: float
    draft_tokens: int
    expected_tokens_per_step: float
    deploy: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def verdict(
    pairs: Sequence[tuple[TopK, TopK]],
    prompts: int,
    skipped: int,
    threshold: float = 0.85,
    draft_tokens: int = 4,
) -> Verdict:
    """Aggregate per-position (target, draft) top-k pairs into a :class:`Verdict`."""
    if not pairs:
        return Verdict(prompts, 0, skipped, 0.0, math.inf, 0.0, threshold, draft_tokens, 1.0, False,
                       "no comparable positions (do the two models share a tokenizer?)")  # fmt: skip
    sims = np.array([similarity(p, q) for p, q in pairs])
    kls = np.array([kl_divergence(p, q) for p, q in pairs])
    overlaps = np.array([topk_overlap(p, q) for p, q in pairs])
    alpha = float(sims.mean())
    tokens = (1 - alpha ** (draft_tokens + 1)) / (1 - alpha) if alpha < 1 else draft_tokens + 1.0
    deploy = alpha > threshold
    reason = (
        f"similarity {alpha:.3f} {'>' if deploy else '<='} {threshold:g}: "
        + (f"expect {tokens:.2f} tokens per verify step with {draft_tokens} draft tokens"
           if deploy else "the target would reject too many drafted tokens for the draft to pay")
    )  # fmt: skip
    return Verdict(
        prompts, len(pairs), skipped, alpha, float(kls.mean()), float(overlaps.mean()), threshold,
        draft_tokens, float(tokens), deploy, reason,
    )  # fmt: skip


def target_positions(choice: Mapping[str, Any]) -> tuple[list[str], list[dict[str, float]]]:
    """Tokens and top-k maps of a completions ``choice`` (``logprobs.tokens`` / ``.top_logprobs``)."""
    logprobs = choice.get("logprobs") or {}
    tokens = list(logprobs.get("tokens") or [])
    tops = [dict(t) if isinstance(t, dict) else {} for t in (logprobs.get("top_logprobs") or [])]
    if len(tokens) != len(tops):
        raise ValueError("logprobs.tokens and logprobs.top_logprobs differ in length")
    return tokens, tops


def pair_positions(
    target: tuple[list[str], list[dict[str, float]]], draft: tuple[list[str], list[dict[str, float]]]
) -> tuple[list[tuple[TopK, TopK]], int]:
    """Align the target's generated positions with the tail of the draft's echoed scoring: the draft
    echo holds prompt + target text + one generated token, so the target's ``n`` positions are the
    draft's ``[-(n + 1):-1]``. Returns the comparable pairs and the count of skipped positions."""
    tokens, tops = target
    d_tokens, d_tops = draft
    n = len(tokens)
    if n == 0 or len(d_tokens) < n + 1:
        return [], n
    d_tokens, d_tops = d_tokens[-(n + 1) : -1], d_tops[-(n + 1) : -1]
    pairs: list[tuple[TopK, TopK]] = []
    for tok, top, d_tok, d_top in zip(tokens, tops, d_tokens, d_tops, strict=True):
        if tok == d_tok and top and d_top:
            pairs.append((top, d_top))
    return pairs, n - len(pairs)
