from __future__ import annotations

import csv
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from detectors.novelty import LevelNoveltyScorer
from detectors.streaming import score_series

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nab"
STEP = 300.0


def noise(n: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(10.0, 1.0, n)


def scores_of(x: np.ndarray, **params: float) -> np.ndarray:
    return score_series(LevelNoveltyScorer(**params), STEP * np.arange(x.size), x)  # type: ignore[arg-type]


def test_value_far_outside_the_range_scores_near_one() -> None:
    x = noise()
    x[800] = 40.0
    assert scores_of(x)[800] > 0.99


def test_values_inside_occupied_bins_score_zero() -> None:
    x = noise()
    x[800] = 10.0  # the centre of the distribution: its bin is full
    assert scores_of(x)[800] == 0.0


def test_a_new_level_one_bin_away_scores_base() -> None:
    # Range 0..20 in 20 bins of 1, the first centred on 0: 20 sits in bin 20 and 20.9 in bin 21.
    x = np.concatenate([np.tile([0.0, 20.0], 300), [20.9, 22.9]])
    s = scores_of(x, base=0.9, rest=0)
    assert s[-2] == pytest.approx(0.9) and s[-1] == pytest.approx(0.95)  # two bins from the nearest


def test_an_empty_bin_inside_the_range_is_novel() -> None:
    x = np.concatenate([np.tile([0.0, 20.0], 300), [10.0]])  # bimodal: nothing ever sat in between
    assert scores_of(x)[-1] >= 0.9


def test_rest_period_reports_one_excursion_once() -> None:
    x = noise()
    x[800:810] = 40.0
    s = scores_of(x)
    assert s[800] > 0.9 and s[801:1000].max() == 0.0


def test_a_larger_jump_during_the_rest_period_still_reports() -> None:
    x = noise()
    x[800], x[850] = 20.0, 60.0
    s = scores_of(x)
    assert s[800] > 0.9 and s[850] > s[800]


def test_without_rest_every_novel_point_reports() -> None:
    x = noise()
    x[800], x[805] = 40.0, 80.0
    s = scores_of(x, rest=0)
    assert s[800] > 0.9 and s[805] > 0.9


def test_old_levels_are_forgotten_after_history_points() -> None:
    x = np.concatenate([np.full(200, 30.0), noise(1200)])  # 30 is seen only in the first 200 points
    x = np.append(x, 30.0)
    assert scores_of(x, history=500)[-1] > 0.9
    assert scores_of(x, history=5000)[-1] == 0.0


def test_bins_are_recut_when_the_range_grows() -> None:
    scorer = LevelNoveltyScorer(requant_every=100)
    x = np.concatenate([noise(600), 10.0 * noise(600, seed=1)])  # spread grows tenfold
    score_series(scorer, STEP * np.arange(x.size), x)
    assert scorer.width_ > 5.0 * (noise(600).max() - noise(600).min()) / scorer.levels


def test_a_flat_line_with_float_jitter_is_not_novel() -> None:
    x = np.full(600, 45.0)
    x[400:] += 1e-12
    assert scores_of(x).max() == 0.0


def load(name: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    with open(FIXTURES / name, newline="") as handle:
        rows = list(csv.reader(handle))[1:]
    stamps = [r[0] for r in rows]
    t = np.array([datetime.fromisoformat(s).replace(tzinfo=UTC).timestamp() for s in stamps])
    return stamps, t, np.array([float(r[1]) for r in rows])


def test_nab_jumpsup_first_alarm_lands_in_the_labelled_window() -> None:
    stamps, t, x = load("art_daily_jumpsup.csv")
    scores = score_series(LevelNoveltyScorer(), t, x)
    start, end = stamps.index("2014-04-10 16:15:00"), stamps.index("2014-04-12 01:45:00")
    probation = min(int(0.15 * len(x)), 750)
    first = probation + int(np.argmax(scores[probation:] >= 0.9))
    assert start <= first <= end
