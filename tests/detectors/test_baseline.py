from __future__ import annotations

import numpy as np

from detectors.baseline import DynamicBaseline

STEP = 300.0


def run(x: np.ndarray, **kwargs: float) -> DynamicBaseline:
    baseline = DynamicBaseline(**kwargs)  # type: ignore[arg-type]
    for i, v in enumerate(x):
        baseline.learn(i * STEP, float(v))
    return baseline


def daily(days: int, noise: float = 1.0, seed: int = 0) -> np.ndarray:
    t = STEP * np.arange(days * 288)
    return (
        100.0 + 30.0 * np.sin(2 * np.pi * t / 86_400.0) + np.random.default_rng(seed).normal(0, noise, t.size)
    )


def test_learns_daily_profile_after_two_days() -> None:
    b = run(daily(4))
    assert b.profile_ is not None and b.strength_ > 0.9
    peak = b.expect(4 * 86_400.0 + 21_600.0)  # 06:00, the sine's maximum
    assert abs(peak.center - 130.0) < 3.0


def test_noise_without_seasonality_gets_no_profile() -> None:
    b = run(np.random.default_rng(1).normal(10.0, 1.0, 4 * 288))
    assert b.profile_ is None
    assert 0.7 < b.expect(0.0).spread < 1.3


def test_spread_is_robust_to_one_outlier() -> None:
    x = np.random.default_rng(2).normal(0.0, 1.0, 600)
    x[300] = 1e6
    assert run(x).expect(0.0).spread < 2.0


def test_level_follows_a_trend() -> None:
    x = 0.1 * np.arange(1000) + np.random.default_rng(3).normal(0.0, 0.5, 1000)
    assert abs(run(x).expect(1000 * STEP).center - 100.0) < 5.0


def test_seasonal_spike_has_large_z() -> None:
    b = run(daily(3))
    t = 3 * 86_400.0 + 21_600.0
    assert abs(b.expect(t).zscore(130.0)) < 3.0
    assert abs(b.expect(t).zscore(160.0)) > 10.0


def test_expect_does_not_change_state() -> None:
    b = run(daily(1))
    before = (b.level_, b.spread_)
    b.expect(123.0)
    assert (b.level_, b.spread_) == before
