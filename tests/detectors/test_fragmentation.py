"""FragmentationDetector: allocator and KV-cache waste above 15%, with its trend."""

from __future__ import annotations

import math

import pytest

from detectors.base import Severity
from detectors.fragmentation import FragmentationDetector
from detectors.snapshot import Reading, Snapshot, SourceStatus

GIB = float(1 << 30)


def _snap(now: float, values: dict[str, float]) -> Snapshot:
    return Snapshot.from_readings(now, {"t": Reading("t", now, SourceStatus.OK, values)})


def _allocator(now: float, ratio: float, reserved: float = 20 * GIB) -> Snapshot:
    return _snap(now, {"probe.reserved_bytes": reserved, "probe.allocated_bytes": reserved * (1 - ratio)})


def test_fires_on_allocator_waste_above_threshold_with_rising_trend() -> None:
    detector = FragmentationDetector()
    findings = []
    for i in range(600):
        findings = detector.update(_allocator(i * 1.0, 0.10 + 0.10 * i / 600))
    assert len(findings) == 1
    finding = findings[0]
    assert finding.signal == "probe.fragmentation_ratio"
    assert finding.severity is Severity.WARNING
    assert finding.evidence["trend"] == "rising"
    assert float(finding.evidence["wasted_bytes"]) > 0.15 * 20 * GIB


def test_silent_below_threshold() -> None:
    detector = FragmentationDetector()
    assert all(detector.update(_allocator(float(i), 0.12)) == [] for i in range(300))


def test_single_spike_does_not_fire() -> None:
    detector = FragmentationDetector()
    ratios = [0.05] * 10 + [0.5] + [0.05] * 10
    assert all(detector.update(_allocator(float(i), r)) == [] for i, r in enumerate(ratios))


def test_critical_at_twice_the_threshold() -> None:
    detector = FragmentationDetector()
    findings = [f for i in range(5) for f in detector.update(_allocator(float(i), 0.4))]
    assert findings and findings[-1].severity is Severity.CRITICAL


def test_small_pool_is_ignored() -> None:
    detector = FragmentationDetector()
    assert all(detector.update(_allocator(float(i), 0.9, reserved=1e6)) == [] for i in range(10))


def test_per_device_and_direct_ratio() -> None:
    detector = FragmentationDetector()
    values = {
        "probe.device1.reserved_bytes": 10 * GIB,
        "probe.device1.allocated_bytes": 5 * GIB,
        "probe.fragmentation_ratio": 0.3,
    }
    findings = [f for i in range(5) for f in detector.update(_snap(float(i), values))]
    assert {f.signal for f in findings} == {"probe.device1.fragmentation_ratio", "probe.fragmentation_ratio"}


def test_kv_cache_fragmentation_where_derivable() -> None:
    detector = FragmentationDetector()
    values = {
        "engine.kv_cache_usage_ratio": 0.5,
        "engine.kv_cache_capacity_tokens": 100_000.0,
        "engine.kv_cache_tokens_held": 35_000.0,
    }
    findings = [f for i in range(5) for f in detector.update(_snap(float(i), values))]
    assert findings[-1].signal == "engine.kv_cache_fragmentation_ratio"
    assert math.isclose(float(findings[-1].evidence["ratio"]), 0.3)


def test_absent_and_nan_signals_are_silent() -> None:
    detector = FragmentationDetector()
    assert detector.update(_snap(0.0, {})) == []
    assert detector.update(_snap(1.0, {"probe.reserved_bytes": math.nan, "probe.allocated_bytes": 1.0})) == []
    assert detector.update(_snap(2.0, {"engine.kv_cache_usage_ratio": 0.5})) == []


def test_deterministic() -> None:
    def run() -> list[dict[str, object]]:
        detector = FragmentationDetector()
        return [f.to_json() for i in range(50) for f in detector.update(_allocator(float(i), 0.1 + i / 200))]

    assert run() == run()


def test_a_held_alarm_shows_its_last_hit_not_a_ratio_back_under_the_threshold() -> None:
    """3 of 5 keeps the alarm up through a tick at 10%: it shows the 20% it fired on, and the 10% now
    (before, its summary read "10% ... (threshold 15%)" with score 0 while active)."""
    detector = FragmentationDetector()
    findings = [detector.update(_allocator(float(i), r)) for i, r in enumerate([0.2, 0.2, 0.2, 0.1])]
    fired, held = findings[2], findings[3]
    assert len(held) == 1 and held[0].score == fired[0].score > 0.5
    assert held[0].evidence["ratio"] == fired[0].evidence["ratio"] == pytest.approx(0.2)
    assert held[0].evidence["now"] == "10%" and held[0].evidence["held"] == "yes"
    assert held[0].summary.startswith("20% allocator memory") and held[0].summary.endswith("; now 10%)")
    assert held[0].since == fired[0].since == 2.0
