from __future__ import annotations

import math

import pytest

from detectors.streaming import SCORERS, ScorerBase, clamp_score, register_scorer


class Echo(ScorerBase):
    """Scores the value itself; remembers what it learned."""

    def __init__(self, warmup: int = 2) -> None:
        super().__init__(warmup)
        self.seen: list[float] = []

    def _score(self, t: float, x: float) -> float:
        return x

    def _learn(self, t: float, x: float) -> None:
        self.seen.append(x)


@pytest.mark.parametrize(
    ("raw", "expected"), [(-1.0, 0.0), (0.3, 0.3), (7.0, 1.0), (math.nan, 0.0), (math.inf, 1.0)]
)
def test_clamp_score(raw: float, expected: float) -> None:
    assert clamp_score(raw) == expected


def test_warm_up_scores_zero_then_scores() -> None:
    e = Echo(warmup=2)
    assert [e.update(i, 0.7) for i in range(3)] == [0.0, 0.0, 0.7]


def test_non_finite_points_score_zero_and_are_not_learned() -> None:
    e = Echo(warmup=0)
    assert e.update(0.0, math.nan) == 0.0 and e.update(math.inf, 0.5) == 0.0
    assert e.seen == [] and e.n_seen == 0


def test_duplicate_registration_is_refused() -> None:
    register_scorer("test-echo", Echo, default_enabled=False, description="x")
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_scorer("test-echo", Echo, default_enabled=False, description="x")
    finally:
        del SCORERS["test-echo"]
