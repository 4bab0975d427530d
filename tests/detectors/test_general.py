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
    distinct = {(f.signal, f.since): f for f in findings}
    assert [s for s, since in distinct if since == 1400 * 5.0] == ["engine.kv_cache_usage_ratio"]
    assert distinct[("engine.kv_cache_usage_ratio", 1400 * 5.0)].evidence["value"] == 0.95


def test_a_raised_alarm_stays_active_for_the_hold_time_then_clears() -> None:
    det = detector(hold_s=30.0)
    noise = np.random.default_rng(0).normal(0.5, 0.01, 1500)
    noise[1400] = 0.95
    active_at = {
        i: len(det.update(snap(i * 5.0, engine__kv_cache_usage_ratio=float(v)))) for i, v in enumerate(noise)
    }
    assert active_at[1400] == 1
    assert active_at[1406] == 1  # 30 s later: still active
    assert active_at[1407] == 0  # past the hold


def test_counters_and_redundant_views_are_not_watched_by_default() -> None:
    det = detector()
    det.update(
        snap(
            0.0,
            nvml__gpu0__energy_joules=1e6,
            nvml__gpu0__utilization_ratio__max=1.0,
            nvml__gpu0__utilization_ratio__mean=0.5,
            probe__ooms_total=0.0,
            engine__ttft_seconds__p99=0.2,
        )
    )
    assert set(det.scorers_) == {"nvml.gpu0.utilization_ratio.mean", "engine.ttft_seconds.p99"}


def test_signals_outside_the_prefixes_are_ignored() -> None:
    det = detector()
    det.update(snap(0.0, engine__requests_running=3.0, other__thing=1.0))
    assert set(det.scorers_) == {"engine.requests_running"}


def test_max_signals_bounds_memory() -> None:
    det = detector(max_signals=2)
    det.update(snap(0.0, engine__a=1.0, engine__b=1.0, engine__c=1.0))
    assert len(det.scorers_) == 2


def test_a_signal_that_appears_later_is_scored_from_then_on() -> None:
    det = detector()
    for i in range(5):
        det.update(snap(float(i), engine__a=1.0))
    assert set(det.scorers_) == {"engine.a"}
    for i in range(5, 10):
        det.update(snap(float(i), engine__a=1.0, engine__b=2.0))
    assert set(det.scorers_) == {"engine.a", "engine.b"}
    assert det.scorers_["engine.b"].n_seen == 5
    det.update(snap(10.0, engine__b=2.0))  # a gone: only b is updated
    assert det.scorers_["engine.a"].n_seen == 10 and det.scorers_["engine.b"].n_seen == 6
