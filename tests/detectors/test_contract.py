"""The contract every registered univariate scorer honours (scikit-learn's parametrize_with_checks idea).

Parametrised from the registry, so a scorer added to :func:`detectors.registry.register_defaults` is
checked here without editing this file.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from detectors.registry import register_defaults
from detectors.streaming import SCORERS, StreamingScorer, score_series

register_defaults()
NAMES = sorted(SCORERS)
STEP = 300.0


def fresh(name: str) -> StreamingScorer:
    return SCORERS[name].factory()


def noisy(n: int = 900, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = 1_400_000_000.0 + STEP * np.arange(n)
    x = 50.0 + 10.0 * np.sin(2 * np.pi * t / 86_400.0) + rng.normal(0.0, 1.0, n)
    return t, x


@pytest.mark.parametrize("name", NAMES)
def test_is_a_streaming_scorer(name: str) -> None:
    assert isinstance(fresh(name), StreamingScorer)


@pytest.mark.parametrize("name", NAMES)
def test_scores_are_finite_and_in_unit_interval(name: str) -> None:
    t, x = noisy()
    x[600] += 80.0
    scores = score_series(fresh(name), t, x)
    assert scores.shape == x.shape
    assert np.all(np.isfinite(scores)) and scores.min() >= 0.0 and scores.max() <= 1.0


@pytest.mark.parametrize("name", NAMES)
def test_no_lookahead(name: str) -> None:
    t, x = noisy()
    changed = x.copy()
    changed[501:] = np.random.default_rng(1).normal(500.0, 50.0, changed.size - 501)
    a, b = score_series(fresh(name), t, x), score_series(fresh(name), t, changed)
    assert np.array_equal(a[:501], b[:501])
    assert not np.array_equal(a[501:], b[501:])


@pytest.mark.parametrize("name", NAMES)
def test_warm_up_scores_zero(name: str) -> None:
    scorer = fresh(name)
    warmup = max(1, int(getattr(scorer, "warmup", 1)))
    t, x = noisy()
    x[: warmup + 1] += np.where(np.arange(warmup + 1) % 2, 1e6, -1e6)  # wild values during warm-up
    assert np.all(score_series(scorer, t[:warmup], x[:warmup]) == 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_nan_rows_score_zero_and_teach_nothing(name: str) -> None:
    t, x = noisy()
    holes = x.copy()
    holes[[300, 301, 640]] = [math.nan, math.inf, math.nan]
    with_holes = score_series(fresh(name), t, holes)
    assert with_holes[[300, 301, 640]].tolist() == [0.0, 0.0, 0.0]
    keep = np.isfinite(holes)
    assert np.array_equal(with_holes[keep], score_series(fresh(name), t[keep], x[keep]))


@pytest.mark.parametrize("name", NAMES)
def test_gaps_and_repeated_timestamps(name: str) -> None:
    t, x = noisy()
    t = t.copy()
    t[400:] += 2 * 86_400.0  # a two-day gap
    t[700:712] = t[700]  # DST-style repeated stamps, then time steps back
    t[712:] -= 3600.0
    scores = score_series(fresh(name), t, x)
    assert np.all(np.isfinite(scores)) and scores.min() >= 0.0 and scores.max() <= 1.0


@pytest.mark.parametrize("name", NAMES)
def test_constant_series_scores_low(name: str) -> None:
    t = STEP * np.arange(800, dtype=float)
    scores = score_series(fresh(name), t, np.full(800, 45.0))
    assert scores.max() <= 0.1


@pytest.mark.parametrize("name", NAMES)
def test_counter_reset_is_flagged_then_forgotten(name: str) -> None:
    n = 1200
    t = STEP * np.arange(n, dtype=float)
    x = np.concatenate([1000.0 + 5.0 * np.arange(700), 5.0 * np.arange(n - 700)])
    x += np.random.default_rng(3).normal(0.0, 2.0, n)
    scores = score_series(fresh(name), t, x)
    assert np.all(np.isfinite(scores)) and scores.max() <= 1.0
    assert scores[700] >= 0.5
    assert np.median(scores[-200:]) < 0.5


@pytest.mark.parametrize("name", NAMES)
def test_deterministic(name: str) -> None:
    t, x = noisy(seed=11)
    assert np.array_equal(score_series(fresh(name), t, x), score_series(fresh(name), t, x))


@pytest.mark.parametrize("name", NAMES)
def test_score_one_predicts_update_without_changing_state(name: str) -> None:
    t, x = noisy(n=500)
    scorer, twin = fresh(name), fresh(name)
    for ti, xi in zip(t, x, strict=True):
        peek = scorer.score_one(float(ti), float(xi))
        assert scorer.score_one(float(ti), float(xi)) == peek
        assert scorer.update(float(ti), float(xi)) == peek
        twin.learn_one(float(ti), float(xi))
    assert twin.score_one(1e12, 1e6) == scorer.score_one(1e12, 1e6)
