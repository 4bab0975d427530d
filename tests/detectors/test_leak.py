"""MemoryLeakDetector on memory shaped by real load (Azure 2024 code trace, Monday morning ramp)."""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from detectors.base import Finding, Severity
from detectors.leak import MemoryLeakDetector
from detectors.snapshot import Reading, Snapshot, SourceStatus

FIXTURE = (
    Path(__file__).parents[1] / "fixtures" / "detectors" / "azure2024_coding_counts_10s_mon0600-1200.csv"
)
GIB, MIB = float(1 << 30), float(1 << 20)
TOTAL = 80 * GIB


def _snap(now: float, values: dict[str, float]) -> Snapshot:
    return Snapshot.from_readings(now, {"t": Reading("t", now, SourceStatus.OK, values)})


def _load() -> np.ndarray:
    with FIXTURE.open() as handle:
        rows = list(csv.reader(handle))[1:]
    return np.minimum(np.array([float(r[1]) for r in rows]) / 10.0 * 4.0, 256.0)


@functools.cache
def _series(
    creep_per_hour: float = 0.0, onset_s: float = 3 * 3600.0, base: float = 60 * GIB
) -> tuple[Snapshot, ...]:
    running = _load()
    rng = np.random.default_rng(1)
    t = np.arange(len(running)) * 10.0
    memory = base + running * 24 * MIB + rng.normal(0, 64 * MIB, len(t))
    memory += np.floor(np.maximum(t - onset_s, 0) / 600.0) * (t >= onset_s) * creep_per_hour * TOTAL / 6
    return tuple(
        _snap(
            float(now),
            {
                "engine.requests_running": float(r),
                "nvml.gpu0.memory_used_bytes": float(m),
                "nvml.gpu0.memory_total_bytes": TOTAL,
            },
        )
        for now, r, m in zip(t, running, memory, strict=True)
    )


def _run(
    snapshots: Sequence[Snapshot], detector: MemoryLeakDetector | None = None
) -> list[tuple[float, Finding]]:
    detector = detector or MemoryLeakDetector()
    return [(s.now, f) for s in snapshots for f in detector.update(s)]


def test_detects_one_percent_per_hour_creep_within_an_hour() -> None:
    hits = _run(_series(creep_per_hour=0.01))
    assert hits, "creep not detected"
    first_at, finding = hits[0]
    assert 3 * 3600 <= first_at <= 4 * 3600
    assert finding.signal == "nvml.gpu0.memory_used_bytes"
    assert 0.3 * GIB < float(finding.evidence["slope_bytes_per_hour"]) < 2 * GIB


def test_silent_when_memory_only_follows_a_morning_load_ramp() -> None:
    assert _run(_series()) == []


def test_evidence_lists_the_steps_and_time_to_exhaustion() -> None:
    finding = _run(_series(creep_per_hour=0.01))[-1][1]
    assert float(finding.evidence["step_count"]) >= 1
    assert "t=" in str(finding.evidence["steps"]) and "MiB" in str(finding.evidence["steps"])
    tte = float(finding.evidence["time_to_exhaustion_s"])
    assert 10 * 3600 < tte < 40 * 3600  # ~14 GiB headroom at ~0.8 GiB/h
    assert finding.severity is Severity.WARNING


def test_critical_when_memory_runs_out_within_four_hours() -> None:
    hits = _run(_series(creep_per_hour=0.03, base=TOTAL - 8 * GIB))
    assert hits[-1][1].severity is Severity.CRITICAL
    assert float(hits[-1][1].evidence["time_to_exhaustion_s"]) < 4 * 3600


def test_silent_without_any_load_signal() -> None:
    snaps = [
        _snap(s.now, {k: v for k, v in s.values.items() if not k.startswith("engine.")})
        for s in _series(creep_per_hour=0.01)
    ]
    assert _run(snaps) == []


def test_finding_clears_once_the_growth_is_released() -> None:
    snaps = []
    for s in _series():
        extra = 1.5 * GIB if 3600 <= s.now < 7200 else 0.0  # held for an hour, then given back
        values = dict(s.values)
        values["nvml.gpu0.memory_used_bytes"] += extra
        snaps.append(_snap(s.now, values))
    hits = _run(snaps)
    assert hits, "a held step should first look like a leak"
    assert max(t for t, _ in hits) < 7200 + 600


def test_nan_values_and_a_two_hour_gap_neither_crash_nor_alarm() -> None:
    snaps = [s for s in _series() if not 2 * 3600 <= s.now < 4 * 3600]
    poisoned = [_snap(s.now, {**s.values, "nvml.gpu0.memory_used_bytes": math.nan}) for s in snaps[::7]]
    merged = sorted([*snaps, *poisoned], key=lambda s: s.now)
    assert _run(merged) == []


def test_time_stepping_back_is_ignored() -> None:
    snaps = list(_series()[:400])
    detector = MemoryLeakDetector()
    _run(snaps, detector)
    before = len(detector.series_["nvml.gpu0.memory_used_bytes"].buckets)
    detector.update(snaps[10])
    assert len(detector.series_["nvml.gpu0.memory_used_bytes"].buckets) == before


@pytest.mark.parametrize("creep", [0.0, 0.01])
def test_same_input_gives_same_findings(creep: float) -> None:
    snaps = _series(creep_per_hour=creep)
    first = [(t, f.to_json()) for t, f in _run(snaps)]
    second = [(t, f.to_json()) for t, f in _run(snaps)]
    assert first == second


def test_series_of_an_exited_process_is_forgotten() -> None:
    detector = MemoryLeakDetector(window_s=600.0)
    detector.update(_snap(0.0, {"nvml.gpu0.process_used_bytes.pid7": 1e9, "engine.requests_running": 1.0}))
    detector.update(_snap(700.0, {"engine.requests_running": 1.0}))
    assert "nvml.gpu0.process_used_bytes.pid7" not in detector.series_


def test_series_are_analysed_in_phases_not_all_on_one_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 GPUs' memory series: each still analysed once per interval, but at most 2 on any one tick."""
    detector = MemoryLeakDetector()
    per_tick: dict[float, int] = {}

    def counting(name: str, series: object, now: float, total: float | None) -> None:
        per_tick[now] = per_tick.get(now, 0) + 1

    monkeypatch.setattr(detector, "_analyse", counting)
    values = {"engine.requests_running": 8.0}
    values |= {f"nvml.gpu{i}.memory_used_bytes": 40 * GIB for i in range(16)}
    for now in range(0, 600):
        detector.update(_snap(float(now), values))
    assert max(per_tick.values()) <= 2
    assert sum(per_tick.values()) == 16 * 5  # 600 s / 120 s: five analyses per series
