"""Speculative decoding in the simulated engine: drafts, their acceptance, and what they cost.

With ``draft_tokens`` :math:`K > 0`, every decoding sequence of a step carries :math:`K` draft tokens
(an n-gram lookup or a draft model proposed them) that the target model verifies in the same forward
pass, so the step computes :math:`1 + K` tokens per decoding sequence instead of 1 (the roofline step
time prices them: at small batch nearly free, at large batch compute). Draft token :math:`j` is accepted
only if every earlier one was, each with probability :math:`\\alpha` (``acceptance``), so the step emits
:math:`1 + a` tokens, :math:`a` the run of leading acceptances, :math:`E[1 + a] = (1 - \\alpha^{K+1}) /
(1 - \\alpha)` (Leviathan et al., 2023). A draft model's own forward passes add ``draft_cost`` of the
step per draft token (0 for an n-gram lookup, which runs on the CPU).

The counters are vLLM V1's: drafts (one per decoding sequence and step), draft tokens, accepted tokens,
and accepted tokens per position; served as ``vllm:spec_decode_num_*_total``. The acceptance the traffic
gives can be changed at run time through the fault switch ``spec_acceptance`` (sampled traffic, another
language), which is what the spec_decode detector has to notice. A real vLLM's numbers for comparison:
n-gram drafts of 3 tokens accepted 0.84 of draft tokens on greedy traffic, 0.02 on sampled
(``tests/fixtures/expo/vllm-0.32-cpu/*ngram3*``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpecDecodeConfig:
    """``draft_tokens`` 0 is no speculation (the default)."""

    draft_tokens: int = 0
    acceptance: float = 0.7
    draft_cost: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.draft_tokens <= 16:
            raise ValueError(f"spec draft_tokens must be in [0, 16], got {self.draft_tokens}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"spec acceptance must be in [0, 1], got {self.acceptance}")
        if not 0.0 <= self.draft_cost <= 1.0:
            raise ValueError(f"spec draft_cost must be in [0, 1], got {self.draft_cost}")


class SpecDecoder:
    """Draws each step's acceptances and keeps vLLM's spec-decode counters."""

    def __init__(self, config: SpecDecodeConfig) -> None:
        self.config = config
        self.k = config.draft_tokens
        self._rng = np.random.default_rng(config.seed)
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_position = [0] * self.k

    def cost_factor(self) -> float:
        """How much longer a step with decoding sequences runs for the draft model's passes."""
        return 1.0 + self.config.draft_cost * self.k

    def draw(self, count: int, acceptance: float) -> list[int]:
        """Leading accepted draft tokens for ``count`` decoding sequences, at per-token ``acceptance``.
        Not yet counted: :meth:`count` does, once each sequence's cap (tokens left, KV room) applied."""
        if count <= 0:
            return []
        accepted = self._rng.random((count, self.k)) < acceptance
        return [int(n) for n in np.cumprod(accepted, axis=1).sum(axis=1)]

    def count(self, accepted: int) -> None:
        """One draft of ``k`` tokens verified, its first ``accepted`` kept."""
        self.drafts += 1
        self.draft_tokens += self.k
        self.accepted += accepted
        per_position = self.accepted_per_position
        for j in range(accepted):
            per_position[j] += 1
