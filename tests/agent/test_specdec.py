"""The draft-vs-target math: similarity (expected acceptance), KL, top-k overlap, alignment, verdict."""

from __future__ import annotations

import math

import pytest

from agent.specdec import kl_divergence, pair_positions, similarity, topk_overlap, verdict

LN = math.log


def test_identical_distributions_are_fully_similar() -> None:
    p = {"a": LN(0.6), "b": LN(0.3), "c": LN(0.1)}
    assert similarity(p, p) == pytest.approx(1.0) and kl_divergence(p, p) == pytest.approx(0.0, abs=1e-9)


def test_similarity_is_one_minus_total_variation_on_full_support() -> None:
    p = {"a": LN(0.5), "b": LN(0.5)}
    q = {"a": LN(0.9), "b": LN(0.1)}
    assert similarity(p, q) == pytest.approx(0.6)  # min(.5,.9) + min(.5,.1)


def test_disjoint_top_k_gives_low_similarity_and_high_kl() -> None:
    p = {"a": LN(0.9), "b": LN(0.05)}
    q = {"x": LN(0.9), "y": LN(0.05)}
    assert similarity(p, q) < 0.1 and kl_divergence(p, q) > 1.0


def test_topk_overlap_counts_shared_tokens() -> None:
    assert topk_overlap({"a": 0.0, "b": 0.0}, {"b": 0.0, "c": 0.0}) == 0.5


def test_positions_align_with_the_tail_of_the_echo() -> None:
    target = (["x", "y"], [{"x": -0.1}, {"y": -0.2}])
    draft = (["p1", "p2", "x", "y", "z"], [{}, {"p2": -1.0}, {"x": -0.3}, {"q": -0.1}, {"z": -0.5}])
    pairs, skipped = pair_positions(target, draft)
    assert pairs == [({"x": -0.1}, {"x": -0.3}), ({"y": -0.2}, {"q": -0.1})] and skipped == 0


def test_mismatched_tokens_are_skipped() -> None:
    target = (["x", "y"], [{"x": -0.1}, {"y": -0.2}])
    draft = (["x", "Y", "z"], [{"x": -0.3}, {"Y": -0.1}, {"z": -0.5}])
    assert pair_positions(target, draft)[1] == 1


def test_verdict_deploys_above_threshold_only() -> None:
    p = {"a": LN(0.95), "b": LN(0.05)}
    close = {"a": LN(0.9), "b": LN(0.1)}
    far = {"a": LN(0.4), "b": LN(0.6)}
    assert verdict([(p, close)] * 3, 1, 0).deploy
    refused = verdict([(p, far)] * 3, 1, 0)
    assert not refused.deploy and "reject" in refused.reason


def test_verdict_without_positions_says_why() -> None:
    result = verdict([], 2, 5)
    assert not result.deploy and "tokenizer" in result.reason
