"""MultivariateAnomalyDetector: Isolation Forest over the state, scored fast, refitted from a window."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.ensemble import IsolationForest

from detectors.multivariate import FlatForest, MultivariateAnomalyDetector, robust_scale
from detectors.snapshot import Reading, Snapshot, SourceStatus

FEATURES = (
    "engine.requests_running",
    "engine.generation_tokens_per_second",
    "nvml.gpu0.utilization_ratio.mean",
    "nvml.gpu0.power_watts.mean",
)


def _snap(now: float, values: dict[str, float]) -> Snapshot:
    return Snapshot.from_readings(now, {"t": Reading("t", now, SourceStatus.OK, values)})


def _normal(rng: np.random.Generator) -> dict[str, float]:
    """A coupled state: throughput, utilisation and power all follow the running batch."""
    running = rng.uniform(5, 60)
    return {
        "engine.requests_running": running,
        "engine.generation_tokens_per_second": 40 * running * rng.normal(1, 0.03),
        "nvml.gpu0.utilization_ratio.mean": min(1.0, 0.2 + running / 80 + rng.normal(0, 0.02)),
        "nvml.gpu0.power_watts.mean": 150 + 8 * running + rng.normal(0, 10),
    }


def _detector() -> MultivariateAnomalyDetector:
    """Learns a row a tick (``learn_every_s=0``), so short tests reach a forest."""
    return MultivariateAnomalyDetector(
        features=FEATURES, window=1024, min_fit=256, refit_every=256, n_estimators=50, learn_every_s=0.0
    )


def _warm(detector: MultivariateAnomalyDetector, n: int = 1200, seed: int = 0) -> list[object]:
    rng = np.random.default_rng(seed)
    return [f for i in range(n) for f in detector.update(_snap(float(i), _normal(rng)))]


def test_flat_forest_matches_scikit_learn() -> None:
    rng = np.random.default_rng(3)
    data = rng.normal(size=(500, 5)) * [1, 10, 100, 0.1, 5]
    forest = IsolationForest(n_estimators=50, max_samples=128, random_state=1).fit(data)
    probe = np.vstack([data[:50], rng.normal(size=(20, 5)) * 30])
    np.testing.assert_allclose(FlatForest(forest).score(probe), -forest.score_samples(probe), rtol=1e-12)


def test_few_false_alarms_on_normal_state() -> None:
    findings = _warm(_detector(), n=2000)
    assert len(findings) <= 5  # 0.5% contamination and a 3-of-5 gate: isolated blips at most


def test_fires_on_high_utilisation_with_low_throughput() -> None:
    detector = _detector()
    _warm(detector)
    stuck = {
        "engine.requests_running": 50.0,
        "engine.generation_tokens_per_second": 300.0,  # a tenth of what 50 running requests produce
        "nvml.gpu0.utilization_ratio.mean": 0.85,
        "nvml.gpu0.power_watts.mean": 560.0,
    }
    findings = [f for i in range(5) for f in detector.update(_snap(2000.0 + i, stuck))]
    assert findings
    assert "engine.generation_tokens_per_second" in str(findings[-1].evidence["top_features"])
    assert float(findings[-1].evidence["anomaly_score"]) > float(findings[-1].evidence["threshold"])


def test_window_is_bounded_and_refits_on_schedule() -> None:
    detector = _detector()
    _warm(detector, n=1300)
    assert len(detector.rows_) == 1024
    assert detector.since_fit_ == (1300 - 256) % 256


def test_too_few_features_skip_the_tick() -> None:
    detector = _detector()
    for i in range(300):
        assert detector.update(_snap(float(i), {"engine.requests_running": 3.0, "x": math.nan})) == []
    assert len(detector.rows_) == 0 and detector.forest_ is None


def test_missing_feature_is_imputed_not_fatal() -> None:
    detector = _detector()
    _warm(detector)
    partial = {k: v for k, v in _normal(np.random.default_rng(9)).items() if "power" not in k}
    assert detector.update(_snap(5000.0, partial)) == []


def test_deterministic() -> None:
    a, b = _detector(), _detector()
    _warm(a, n=600)
    _warm(b, n=600)
    assert a.threshold_ == b.threshold_
    assert a.forest_ is not None and b.forest_ is not None
    probe = np.array([[0.3, -1.2, 0.6, 0.4]])
    assert a.forest_.score(probe)[0] == b.forest_.score(probe)[0]


def test_with_an_executor_the_refit_runs_off_the_tick_and_lands_later() -> None:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from detectors.multivariate import MultivariateAnomalyDetector
    from detectors.snapshot import Snapshot

    features = ("a", "b")
    rng = np.random.default_rng(0)
    with ThreadPoolExecutor(1) as pool:
        det = MultivariateAnomalyDetector(
            features=features, min_fit=64, refit_every=64, executor=pool, learn_every_s=0.0
        )
        for i in range(64):
            det.update(Snapshot(float(i), {"a": float(rng.normal()), "b": float(rng.normal())}, {}))
        assert det.forest_ is None and det.pending_ is not None  # submitted, not waited for
        det.pending_.result(timeout=30)
        det.update(Snapshot(64.0, {"a": 0.0, "b": 0.0}, {}))
        assert det.forest_ is not None and det.pending_ is None


def test_a_row_is_learned_every_learn_every_s_of_data_time() -> None:
    detector = MultivariateAnomalyDetector(features=FEATURES, learn_every_s=10.0)
    rng = np.random.default_rng(1)
    for i in range(100):  # 1 s ticks: every tick is scored, one in ten is learned
        detector.update(_snap(float(i), _normal(rng)))
    assert len(detector.rows_) == 10
    detector.update(_snap(50.0, _normal(rng)))  # time stepped back (a restarted clock): learned at once
    assert len(detector.rows_) == 11


def test_a_feature_mostly_at_zero_is_scaled_by_its_mean_deviation_not_a_vanishing_floor() -> None:
    # prompt tokens per second at low load: 0 on most ticks, a prompt now and then
    data = np.zeros((1000, 2))
    data[::20, 0] = 500.0
    data[:, 1] = np.random.default_rng(2).normal(10.0, 1.0, 1000)
    scale = robust_scale(data, np.median(data, axis=0))
    assert scale[0] == pytest.approx(1.2533 * 25.0)  # the median's MAD is 0: mean |x - 0| = 25
    assert scale[1] == pytest.approx(1.0, rel=0.1)
    constant = robust_scale(np.full((10, 1), 400.0), np.array([400.0]))
    assert constant[0] == pytest.approx(4.0)


def test_the_first_prompt_after_a_quiet_spell_is_not_a_huge_outlier() -> None:
    features = ("engine.requests_running", "engine.prompt_tokens_per_second")
    detector = MultivariateAnomalyDetector(
        features=features, window=512, min_fit=256, refit_every=256, n_estimators=50, learn_every_s=0.0
    )
    rng = np.random.default_rng(3)
    for i in range(600):
        prompt = 400.0 * rng.random() if i % 25 == 0 else 0.0
        detector.update(_snap(float(i), {features[0]: float(rng.integers(1, 4)), features[1]: prompt}))
    assert detector.scale_[1] > 1.0  # was 1e-9: a 300-token prompt stood 3e11 robust z-scores out
    z = (300.0 - detector.median_[1]) / detector.scale_[1]
    assert 5.0 < z < 100.0  # rare, so well out, but on a scale a reader can weigh


STUCK = {
    "engine.requests_running": 50.0,
    "engine.generation_tokens_per_second": 300.0,
    "nvml.gpu0.utilization_ratio.mean": 0.85,
    "nvml.gpu0.power_watts.mean": 560.0,
}


def _episode(detector: MultivariateAnomalyDetector, start: float, rng: np.random.Generator) -> bool:
    """Five stuck ticks, then ten normal ones (the gate falls); whether any finding was reported."""
    reported = [f for i in range(5) for f in detector.update(_snap(start + i, STUCK))]
    for i in range(10):
        detector.update(_snap(start + 5 + i, _normal(rng)))
    return bool(reported)


def test_findings_beyond_the_daily_budget_are_suppressed_and_counted() -> None:
    detector = _detector()
    detector.budget_ = MultivariateAnomalyDetector(max_findings_per_day=2.0).budget_
    _warm(detector)
    rng = np.random.default_rng(4)
    assert [_episode(detector, 2000.0 + 20 * k, rng) for k in range(3)] == [True, True, False]
    assert detector.budget_.suppressed_total_ == 1
    # 2 a day refill one every 12 hours
    assert _episode(detector, 2060.0 + 12 * 3600, rng)


def test_a_row_every_history_every_s_is_kept_for_the_week_behind() -> None:
    detector = MultivariateAnomalyDetector(
        features=FEATURES, learn_every_s=0.0, history_every_s=100.0, history_rows=8, min_fit=10_000
    )
    rng = np.random.default_rng(5)
    for i in range(2000):
        detector.update(_snap(float(i), _normal(rng)))
    assert len(detector.history_) == 8 and detector.kept_at_ == 1900.0  # the last 8 of 20, 100 s apart
