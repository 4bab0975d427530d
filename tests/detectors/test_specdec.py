"""SpecDecodeDetector: acceptance against its baseline, and the speedup falling below 1."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.base import Finding, Severity
from detectors.registry import register_defaults
from detectors.snapshot import Reading, Snapshot, SourceStatus
from detectors.specdec import (
    POSITION_PREFIX,
    SpecDecodeDetector,
    expected_tokens_per_step,
    speedup_by_draft_length,
)


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


# --- which draft length pays best -------------------------------------------------------------------


def _by_position(now: float, shares: list[float], mean_tokens: float | None = None) -> Snapshot:
    """vLLM counters of 100 drafts a second of ``len(shares)`` tokens (``mean_tokens`` drafted on
    average), ``shares[j]`` of which had token ``j`` accepted."""
    drafts = 100.0
    values = {
        "engine.spec_drafts_per_second": drafts,
        "engine.spec_draft_tokens_per_second": drafts * (mean_tokens or len(shares)),
        "engine.spec_accepted_tokens_per_second": drafts * sum(shares),
        **{f"{POSITION_PREFIX}{j}": drafts * share for j, share in enumerate(shares)},
    }
    return Snapshot.from_readings(now, {"e": Reading("e", now, SourceStatus.OK, values)})


def _advice(detector: SpecDecodeDetector, shares: list[float], ticks: int = 40) -> list[Finding]:
    findings: list[Finding] = []
    for i in range(ticks):
        findings = detector.update(_by_position(float(i), shares))
    return [f for f in findings if f.signal == "engine.spec_accepted_by_position_per_second"]


def test_the_speedup_of_each_draft_length_is_the_accepted_prefix_over_its_cost() -> None:
    speedups = speedup_by_draft_length([0.6, 0.15, 0.05], 3.0, 0.1)
    assert speedups == pytest.approx([1.0, 1.6 / 1.1, 1.75 / 1.2, 1.8 / 1.3])
    # drafts of 2.5 tokens on average: a cut to 3 costs what the drafts cost now, not 3 tokens
    assert speedup_by_draft_length([0.6, 0.15, 0.05], 2.5, 0.1)[3] == pytest.approx(1.8 / 1.25)


def test_a_draft_whose_last_tokens_are_rarely_accepted_is_advised_shorter() -> None:
    advice = _advice(SpecDecodeDetector(warmup=5), [0.6, 0.15, 0.05])
    assert len(advice) == 1 and advice[0].severity is Severity.INFO
    assert advice[0].evidence["best_draft_tokens"] == 2 and advice[0].evidence["draft_tokens"] == 3
    assert advice[0].summary == (
        "drafts of 2 tokens instead of 3 would raise the expected speedup from 1.38x to 1.46x "
        "(token 3 of a draft is accepted in 5% of drafts)"
    )
    assert advice[0].hint.startswith("set num_speculative_tokens to 2;")


@pytest.mark.parametrize(
    "shares",
    [
        pytest.param([0.882, 0.748, 0.653], id="greedy n-gram drafts on vLLM (the fixture): all 3 pay"),
        pytest.param([0.6, 0.5, 0.4, 0.35], id="a slowly falling acceptance"),
        pytest.param([0.059, 0.001, 0.001], id="no cut pays: the critical finding says turn it off"),
    ],
)
def test_no_shorter_draft_is_advised_when_none_pays_better(shares: list[float]) -> None:
    assert _advice(SpecDecodeDetector(warmup=5), shares) == []


def test_the_advice_needs_k_of_n_ticks_and_clears_when_the_tail_pays_again() -> None:
    detector = SpecDecodeDetector(warmup=5, length_half_life_s=1.0)
    assert _advice(detector, [0.6, 0.15, 0.05])
    for i in range(40, 60):
        findings = detector.update(_by_position(float(i), [0.6, 0.5, 0.45]))
    assert findings == [] and detector.length_shown_.finding is None


def test_without_per_position_counters_there_is_no_advice() -> None:
    detector = SpecDecodeDetector(warmup=5)
    assert not any(f for i in range(40) for f in detector.update(_vllm(float(i), 0.2, k=3)))


def test_the_realised_decode_tokens_per_step_ride_along_in_the_evidence() -> None:
    """Per drafting step the detector computes 1 + accepted per draft; over every decode step (an n-gram
    lookup that finds nothing drafts nothing) the collector's engine.decode_tokens_per_step is lower,
    and a finding shows both."""
    detector = SpecDecodeDetector(draft_cost_ratio=0.3)
    _run(detector, np.full(60, 0.7))
    snapshot = _vllm(60.0, 0.1)
    values = {**snapshot.values, "engine.decode_tokens_per_step": 1.08}
    for i in range(10):
        found = detector.update(
            Snapshot.from_readings(60.0 + i, {"e": Reading("e", 60.0 + i, SourceStatus.OK, values)})
        )
    assert found and found[0].evidence["decode_tokens_per_step"] == 1.08
    assert float(found[0].evidence["tokens_per_step"]) > 1.08  # per drafting step: 1 + 0.4
