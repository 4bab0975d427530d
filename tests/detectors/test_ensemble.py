from __future__ import annotations

import csv
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from detectors.ensemble import EnsembleScorer
from detectors.streaming import score_series

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nab"


def load(name: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    with open(FIXTURES / name, newline="") as handle:
        rows = list(csv.reader(handle))[1:]
    stamps = [r[0] for r in rows]
    t = np.array([datetime.fromisoformat(s).replace(tzinfo=UTC).timestamp() for s in stamps])
    return stamps, t, np.array([float(r[1]) for r in rows])


def test_spike_in_noise_scores_near_one() -> None:
    x = np.random.default_rng(0).normal(10.0, 1.0, 1500)
    x[1200] = 30.0
    scores = score_series(EnsembleScorer(refractory=0), 300.0 * np.arange(1500), x)
    assert scores[1200] > 0.85  # p = 1/(n+1) with n = 1200 points of history: log(1201)/log(3001)
    assert np.sort(scores[1000:1200])[-3] < 0.7


def test_refractory_damps_the_next_points() -> None:
    x = np.random.default_rng(1).normal(10.0, 1.0, 1500)
    x[1200], x[1210] = 30.0, 31.0
    scores = score_series(EnsembleScorer(damp=0.3), 300.0 * np.arange(1500), x)
    undamped = score_series(EnsembleScorer(refractory=0), 300.0 * np.arange(1500), x)
    assert scores[1210] <= 0.3 < undamped[1210]


def test_level_shift_is_detected_by_distribution_change() -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(10.0, 1.0, 1200), rng.normal(11.5, 1.0, 300)])
    scores = score_series(EnsembleScorer(refractory=0), 300.0 * np.arange(1500), x)
    assert scores[1200:1300].max() > 0.8


def test_nab_jumpsup_first_alarm_lands_in_the_labelled_window() -> None:
    stamps, t, x = load("art_daily_jumpsup.csv")
    scores = score_series(EnsembleScorer(), t, x)
    start, end = stamps.index("2014-04-10 16:15:00"), stamps.index("2014-04-12 01:45:00")
    probation = min(int(0.15 * len(x)), 750)
    first = probation + int(np.argmax(scores[probation:] >= 0.8))
    assert start <= first <= end
