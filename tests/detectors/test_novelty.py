from __future__ import annotations

import csv
import pickle
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from detectors.novelty import LevelNoveltyScorer, staggered_factory
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
    assert scores_of(x, history=500, memory_s=0)[-1] > 0.9
    assert scores_of(x, history=5000, memory_s=0)[-1] == 0.0


def _visit_then_leave(gap_points: int, **params: float) -> tuple[LevelNoveltyScorer, float]:
    """1 s samples: noise around 10, a visit to 30 for 100 points, ``gap_points`` of noise, then 30
    again; returns the scorer and the last point's score."""
    x = np.concatenate([noise(300), np.full(100, 30.0), noise(gap_points, seed=1), [30.0]])
    scorer = LevelNoveltyScorer(history=500, memory_step_s=60.0, **params)
    return scorer, float(score_series(scorer, np.arange(x.size, dtype=float), x)[-1])


def test_a_level_the_window_has_dropped_is_remembered_for_memory_s() -> None:
    # the visit left the 500-point window 1,000 points ago; remembered for 3,000 s it is not new
    scorer, score = _visit_then_leave(1500, memory_s=3000.0)
    assert score == 0.0
    assert any(29.0 < value < 31.0 for step in scorer.memory_ for value in step[2])
    # without the memory it is, and once memory_s has passed since the visit it is again
    assert _visit_then_leave(1500, memory_s=0.0)[1] > 0.9
    assert _visit_then_leave(3500, memory_s=3000.0)[1] > 0.9


def test_remembered_levels_widen_the_range_the_bins_are_cut_from() -> None:
    scorer, _ = _visit_then_leave(1500, memory_s=3000.0)
    assert 0 <= scorer._symbol(30.0) <= scorer.levels  # 30 lies inside the bins cut, not beyond them
    # the window alone (noise around 10) would cut bins a tenth as wide
    alone, _ = _visit_then_leave(1500, memory_s=0.0)
    assert scorer.width_ > 3.0 * alone.width_


def test_coarse_data_keeps_nothing_behind_the_window_in_memory() -> None:
    # 5-minute samples (NAB): 5,000 points are 17 days, longer than the 7 days remembered
    scorer = LevelNoveltyScorer()
    score_series(scorer, STEP * np.arange(6000), noise(6000))
    assert not scorer.memory_ and not scorer.remembered_ and scorer.pending_


def test_time_stepping_back_closes_the_memory_step() -> None:
    scorer = LevelNoveltyScorer(memory_step_s=60.0)
    for t in (100.0, 110.0, 120.0, 105.0, 90.0):  # an hour repeated at a daylight-saving change, say
        scorer.update(t, 1.0)
    # 105 is still inside the step begun at 100; 90 is before it
    assert len(scorer.pending_) == 1 and scorer.step_t_ == 90.0


@pytest.mark.parametrize("params", [{"memory_s": -1.0}, {"memory_step_s": 0.0}])
def test_a_negative_memory_or_an_empty_step_is_refused(params: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="memory needs"):
        LevelNoveltyScorer(**params)


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


def test_rest_period_is_the_maximum_of_the_previous_rest_raw_novelties() -> None:
    # The running maximum must equal the naive rule: report raw only if it beats max(raw[i-rest:i]).
    x = noise(3000, seed=4)
    x[np.random.default_rng(5).integers(300, 3000, 40)] += np.random.default_rng(6).normal(0, 8, 40)
    rest = 25
    raw = scores_of(x, rest=0)
    expected = np.array(
        [r if i == 0 or r > raw[max(0, i - rest) : i].max() else 0.0 for i, r in enumerate(raw)]
    )
    assert raw.max() > 0.9  # the injected outliers do score
    np.testing.assert_array_equal(scores_of(x, rest=rest), expected)


@pytest.mark.parametrize("history", [5000, 500])  # 500: the window's ring has wrapped
def test_recut_symbols_equal_the_per_value_symbols(history: int) -> None:
    scorer = LevelNoveltyScorer(requant_every=100, history=history)
    x = np.concatenate([noise(600), 10.0 * noise(600, seed=1)])
    score_series(scorer, STEP * np.arange(x.size), x)
    window = scorer._window()
    assert len(window) == len(scorer.symbols_) == min(history, x.size)
    np.testing.assert_array_equal(window, x[-len(window) :])
    assert list(scorer.symbols_) == [scorer._symbol(float(v)) for v in window]
    counts: dict[int, int] = {}
    for s in scorer.symbols_:
        counts[s] = counts.get(s, 0) + 1
    assert scorer.counts_ == counts


def test_remembered_counts_follow_the_recuts() -> None:
    # 1 s samples whose spread grows while older steps join the memory: every re-cut re-counts them
    scorer = LevelNoveltyScorer(requant_every=100, history=500, memory_step_s=30.0)
    x = noise(3000) * np.linspace(1.0, 10.0, 3000)
    score_series(scorer, np.arange(x.size, dtype=float), x)
    assert scorer.memory_
    remembered: dict[int, int] = {}
    for step in scorer.memory_:
        for value in step[2]:
            s = scorer._symbol(value)
            remembered[s] = remembered.get(s, 0) + 1
    assert scorer.remembered_ == remembered


def _cuts(phase: int = 0) -> list[int]:
    """The points after which the bin width changed."""
    scorer = LevelNoveltyScorer(warmup=50, requant_every=100, tolerance=1.01)
    scorer.phase_ = phase
    widths = []
    x = noise(1000) * np.linspace(1.0, 20.0, 1000)  # a spread that keeps growing: every check re-cuts
    for i, v in enumerate(x):
        scorer.update(STEP * i, float(v))
        widths.append(scorer.width_)
    return [i + 1 for i in range(1, len(widths)) if widths[i] != widths[i - 1]]


def test_requant_phase_moves_the_recut_points() -> None:
    assert _cuts() == [50, *range(100, 1001, 100)]
    # the first cut moves too, within the warm-up (37 % 8 = 5 points early), so scorers do not all cut
    # on the tick their warm-up ends; scoring still starts at the warm-up
    assert _cuts(phase=37) == [45, *range(137, 1001, 100)]


def test_staggered_factory_gives_each_scorer_its_own_phase() -> None:
    make = staggered_factory()
    phases = [make().phase_ % 300 for _ in range(80)]
    assert len(set(phases)) == 80
    # Deterministic: a new factory hands out the same phases in the same order.
    again = staggered_factory()
    assert [again().phase_ for _ in range(80)] == phases


def test_a_pickled_scorer_resumes_exactly_and_holds_no_numpy_objects() -> None:
    scorer = staggered_factory()
    scorer()  # the second scorer made has phase 1
    original = scorer()
    x = noise(6000, seed=8)
    score_series(original, STEP * np.arange(5500), x[:5500])
    data = pickle.dumps(original)
    assert b"numpy" not in data  # agent/persist.py's restricted unpickler admits no numpy class
    restored = pickle.loads(data)
    assert restored.phase_ == 1
    t = STEP * np.arange(5500, 6000)
    np.testing.assert_array_equal(score_series(restored, t, x[5500:]), score_series(original, t, x[5500:]))


def test_a_scorer_saved_before_the_ring_buffer_is_upgraded() -> None:
    x = noise(700, seed=9)
    x[[400, 650]] += [15.0, 40.0]
    reference = LevelNoveltyScorer(history=500)
    expected = score_series(reference, STEP * np.arange(700), x)
    scorer = LevelNoveltyScorer(history=500)
    score_series(scorer, STEP * np.arange(600), x[:600])
    # The old layout: the window as a deque, the last ``rest`` raw novelties instead of peaks_.
    raw = scores_of(x[:600], rest=0, history=500)
    old = {k: v for k, v in vars(scorer).items() if k not in ("values_", "head_", "filled_", "peaks_")}
    old["values_"] = deque(x[100:600].tolist(), maxlen=500)
    old["recent_raw_"] = deque(raw[-200:].tolist(), maxlen=200)
    upgraded = LevelNoveltyScorer.__new__(LevelNoveltyScorer)
    upgraded.__setstate__(old)
    t = STEP * np.arange(600, 700)
    np.testing.assert_array_equal(score_series(upgraded, t, x[600:]), expected[600:])
    assert expected[650] > 0.9
