from __future__ import annotations

import numpy as np

from detectors.ensemble import EnsembleScorer
from detectors.general import GeneralAnomalyDetector
from detectors.snapshot import Snapshot
from detectors.thresholds import Thresholder


def snap(now: float, **values: float) -> Snapshot:
    return Snapshot(now, {k.replace("__", "."): v for k, v in values.items()}, {})


def detector(**kwargs: object) -> GeneralAnomalyDetector:
    return GeneralAnomalyDetector(
        lambda: EnsembleScorer(refractory=0),
        lambda: Thresholder(threshold=0.85, k=1, n=1, max_alarms_per_day=1e6),
        **kwargs,  # type: ignore[arg-type]
    )


def test_spike_in_a_signal_becomes_one_finding() -> None:
    det = detector()
    noise = np.random.default_rng(0).normal(0.5, 0.01, 1500)
    noise[1400] = 0.95
    findings = [
        f
        for i, v in enumerate(noise)
        for f in det.update(snap(i * 5.0, engine__kv_cache_usage_ratio=float(v)))
    ]
    assert [f.signal for f in findings if f.since == 1400 * 5.0] == ["engine.kv_cache_usage_ratio"]
    assert findings[-1].evidence["value"] == 0.95


def test_signals_outside_the_prefixes_are_ignored() -> None:
    det = detector()
    det.update(snap(0.0, engine__requests_running=3.0, other__thing=1.0))
    assert set(det.scorers_) == {"engine.requests_running"}


def test_max_signals_bounds_memory() -> None:
    det = detector(max_signals=2)
    det.update(snap(0.0, engine__a=1.0, engine__b=1.0, engine__c=1.0))
    assert len(det.scorers_) == 2
