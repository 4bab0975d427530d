"""MultivariateAnomalyDetector: Isolation Forest over the state, scored fast, refitted from a window."""

from __future__ import annotations

import math

import numpy as np
from sklearn.ensemble import IsolationForest

from detectors.multivariate import FlatForest, MultivariateAnomalyDetector
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
    return MultivariateAnomalyDetector(
        features=FEATURES, window=1024, min_fit=256, refit_every=256, n_estimators=50
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
        det = MultivariateAnomalyDetector(features=features, min_fit=64, refit_every=64, executor=pool)
        for i in range(64):
            det.update(Snapshot(float(i), {"a": float(rng.normal()), "b": float(rng.normal())}, {}))
        assert det.forest_ is None and det.pending_ is not None  # submitted, not waited for
        det.pending_.result(timeout=30)
        det.update(Snapshot(64.0, {"a": 0.0, "b": 0.0}, {}))
        assert det.forest_ is not None and det.pending_ is None
