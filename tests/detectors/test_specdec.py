"""SpecDecodeDetector: acceptance against its baseline, and the speedup falling below 1."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.base import Finding, Severity
from detectors.registry import register_defaults
from detectors.snapshot import Reading, Snapshot, SourceStatus
from detectors.specdec import SpecDecodeDetector, expected_tokens_per_step


def _vllm(now: float, acceptance: float, k: int = 4, drafts: float = 100.0) -> Snapshot:
    values = {
        "engine.spec_drafts_per_second": drafts,
        "engine.spec_draft_tokens_per_second": drafts * k,
        "engine.spec_accepted_tokens_per_second": drafts * k * acceptance,
    }
    return Snapshot.from_readings(now, {"e": Reading("e", now, SourceStatus.OK, values)})


def _sglang(now: float, rate: float, length: float) -> Snapshot:
    values = {"engine.spec_acceptance_ratio": rate, "engine.spec_accept_length": length}
    return Snapshot.from_readings(now, {"e": Reading("e", now, SourceStatus.OK, values)})


def _run(detector: SpecDecodeDetector, acceptances: np.ndarray, start: float = 0.0) -> list[list[Finding]]:
    return [detector.update(_vllm(start + i, float(a))) for i, a in enumerate(acceptances)]


def test_steady_acceptance_raises_nothing() -> None:
    noise = np.random.default_rng(0).normal(0.7, 0.02, 300)
    assert not any(_run(SpecDecodeDetector(), noise))


def test_acceptance_drop_is_flagged_as_a_warning() -> None:
    detector = SpecDecodeDetector()
    _run(detector, np.full(60, 0.7))
    findings = [f for fs in _run(detector, np.full(10, 0.45), start=60) for f in fs]
    assert findings and findings[-1].severity is Severity.WARNING
    assert findings[-1].evidence["baseline"] == pytest.approx(0.7)


def test_speedup_below_one_is_critical() -> None:
    detector = SpecDecodeDetector(draft_cost_ratio=0.3)
    _run(detector, np.full(60, 0.7))  # E = 2.77 tokens per step vs cost 2.2: pays
    last = _run(detector, np.full(10, 0.1), start=60)[-1]  # E = 1.11 vs 2.2: does not
    assert last and last[0].severity is Severity.CRITICAL
    assert last[0].evidence["expected_speedup"] < 1


def test_a_recovered_tick_inside_a_standing_alarm_shows_the_drop_it_fired_on() -> None:
    detector = SpecDecodeDetector()
    _run(detector, np.full(60, 0.7))
    fired, held = _run(detector, np.array([0.45] * 3 + [0.7]), start=60)[2:]
    assert fired and held and held[0].score == fired[0].score > 0
    assert held[0].evidence["acceptance_ratio"] == pytest.approx(0.45)
    assert str(held[0].evidence["now"]).startswith("acceptance 0.70, expected speedup ")
    assert held[0].summary.startswith("spec-decode acceptance 0.45 is 36% below its baseline 0.70")


def test_lasting_drop_is_not_learned_as_the_new_baseline() -> None:
    detector = SpecDecodeDetector(half_life_s=10.0)
    _run(detector, np.full(60, 0.7))
    _run(detector, np.full(500, 0.4), start=60)
    assert detector.baseline_ == pytest.approx(0.7)


def test_idle_ticks_are_no_evidence() -> None:
    detector = SpecDecodeDetector(warmup=1)
    assert detector.update(_vllm(0.0, 0.7, drafts=0.0)) == [] and detector.baseline_ is None


def test_sglang_gauges_are_read() -> None:
    detector = SpecDecodeDetector(warmup=5)
    for i in range(5):
        detector.update(_sglang(float(i), 0.6, 2.8))
    findings = [detector.update(_sglang(5.0 + i, 0.2, 1.6)) for i in range(5)][-1]
    assert findings and findings[0].severity is Severity.WARNING


def test_expected_tokens_per_step_matches_the_closed_form() -> None:
    assert expected_tokens_per_step(0.0, 4) == 1.0 and expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_registered_by_default() -> None:
    from detectors.base import REGISTRY

    register_defaults()
    assert REGISTRY["spec_decode"].default_enabled and REGISTRY["spec_decode"].factory().name == "spec_decode"
