from __future__ import annotations

import numpy as np
import pytest

from detectors.base import Finding, Severity
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
            engine__ttft_seconds__p99=0.2,  # the tail latency detector's (one signal, one judge)
            engine__itl_seconds__p95=0.02,
            engine__ttft_seconds__mean=0.1,
            engine__spec_accepted_by_position_per_second__position0=80.0,  # the spec_decode detector's
        )
    )
    assert set(det.scorers_) == {"nvml.gpu0.utilization_ratio.mean", "engine.ttft_seconds.mean"}


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


def _production() -> GeneralAnomalyDetector:
    """The general detector as the sidecar builds it (detectors/registry.py), but with an alarm budget
    too large to spend: these tests are about which alarms are warnings, not about how many a day."""
    from detectors.novelty import staggered_factory

    return GeneralAnomalyDetector(
        staggered_factory(), lambda: Thresholder(threshold=0.9, k=1, n=1, max_alarms_per_day=1e6)
    )


def _idle_then_busy(det: GeneralAnomalyDetector, idle: int = 400, busy: int = 40) -> list[list[object]]:
    """Ticks of an idle engine, then traffic arrives: every signal steps with it at once, except the
    temperature, which follows 30 s later. Returns each tick's findings. Bounded noise: its whole range
    is seen during the warm-up, so the idle engine itself raises nothing."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(idle + busy):
        on = i >= idle
        warm = i >= idle + 30
        values = {
            "engine.requests_running": (40.0 if on else 0.0) + float(rng.integers(0, 2)),
            "engine.generation_tokens_per_second": (1300.0 if on else 0.0) + float(rng.uniform(0, 5)),
            "nvml.gpu0.utilization_ratio.mean": (0.8 if on else 0.02) + float(rng.uniform(0, 0.01)),
            "nvml.gpu0.power_watts.mean": (220.0 if on else 60.0) + float(rng.uniform(0, 2)),
            "nvml.gpu0.temperature_celsius.mean": (60.0 if warm else 35.0) + float(rng.uniform(0, 0.5)),
            "probe.allocated_bytes": (7.5e10 if on else 1.5e10) + float(rng.uniform(0, 1e6)),
        }
        out.append(list(det.update(Snapshot(float(i), values, {}))))
    return out


def test_traffic_arriving_is_one_warning_and_the_signals_that_follow_it_are_info() -> None:
    det = _production()
    det.settle_points = 0  # a settled baseline (the fresh one: the next test)
    ticks = _idle_then_busy(det)
    assert not any(ticks[:400]), "an idle engine raises nothing"
    final = {f.signal: f for f in ticks[-1]}  # still active (hold_s 300 s)
    warnings = [f for f in final.values() if f.severity.value == "warning"]
    assert [f.signal for f in warnings] == ["engine.generation_tokens_per_second"]  # the first in order
    assert warnings[0].summary.startswith("the load changed: ")
    followers = {name: f for name, f in final.items() if f.severity.value == "info"}
    assert set(followers) == {
        "engine.requests_running",
        "nvml.gpu0.utilization_ratio.mean",
        "nvml.gpu0.power_watts.mean",
        "nvml.gpu0.temperature_celsius.mean",  # 30 s after the load moved: still with it
        "probe.allocated_bytes",
    }
    assert all(f.evidence["with_load"] == "engine.generation_tokens_per_second" for f in followers.values())


def test_without_the_load_grouping_the_same_traffic_is_six_warnings() -> None:
    det = _production()
    det.load_signals = frozenset()
    ticks = _idle_then_busy(det)
    assert {f.severity.value for f in ticks[-1]} == {"warning"} and len(ticks[-1]) == 6


def test_a_signal_unusual_while_the_load_holds_still_is_a_warning() -> None:
    det = _production()
    rng = np.random.default_rng(2)
    last: list[object] = []
    for i in range(460):
        power = 300.0 if i >= 450 else 220.0  # power jumps with no change of traffic (a fault)
        values = {
            "engine.requests_running": 40.0 + float(rng.integers(0, 2)),
            "nvml.gpu0.power_watts.mean": power + float(rng.uniform(0, 2)),
        }
        last = list(det.update(Snapshot(float(i), values, {})))
    [finding] = last
    assert finding.signal == "nvml.gpu0.power_watts.mean"  # type: ignore[attr-defined]
    assert finding.severity.value == "warning" and "with_load" not in finding.evidence  # type: ignore[attr-defined]


def test_a_signal_unusual_long_after_the_load_moved_is_a_warning_again() -> None:
    det = _production()
    det.hold_s = 1.0  # see each finding on the tick it is raised
    rng = np.random.default_rng(3)
    seen = []
    for i in range(800):
        on = i >= 400
        hot = i >= 700  # 300 s after the traffic came, the temperature alone jumps
        values = {
            "engine.requests_running": (40.0 if on else 0.0) + float(rng.integers(0, 2)),
            "nvml.gpu0.temperature_celsius.mean": (85.0 if hot else 50.0) + float(rng.uniform(0, 0.5)),
        }
        seen.extend(det.update(Snapshot(float(i), values, {})))
    late = [f for f in seen if f.signal == "nvml.gpu0.temperature_celsius.mean" and f.since >= 700]
    assert late and late[0].severity.value == "warning"


def _restarted(det: GeneralAnomalyDetector, restart_at: int, ticks: int) -> list[list[Finding]]:
    """Idle, then busy, then at ``restart_at`` a new engine process (its start time moves): idle for 20
    ticks (a level seen before: no load alarm, as live), then busy again with its step sizes at a level
    never seen (cold)."""
    rng = np.random.default_rng(4)
    out = []
    for i in range(ticks):
        idle = i < 100 or restart_at <= i < restart_at + 20
        values = {
            "engine.process_start_time_seconds": 1e9 + (restart_at if i >= restart_at else 0),
            "engine.requests_running": (0.0 if idle else 40.0) + float(rng.integers(0, 2)),
            "engine.iteration_tokens.p95": (0.0 if idle else 256.0 if i >= restart_at else 64.0)
            + float(rng.uniform(0, 2)),
        }
        out.append(list(det.update(Snapshot(float(i), values, {}))))
    return out


def test_an_engine_restart_is_one_info_finding_and_what_moves_after_it_is_info() -> None:
    """Beside a vLLM killed and restarted under load, its tokens per step raised a warning within 5 s of
    its being back, for a change whose cause was known."""
    det = _production()
    ticks = _restarted(det, restart_at=500, ticks=560)
    assert not any(ticks[420:500])
    final = {f.signal: f for f in ticks[-1]}
    assert set(final) == {"engine.process_start_time_seconds", "engine.iteration_tokens.p95"}
    assert {f.severity for f in final.values()} == {Severity.INFO}
    restart = final["engine.process_start_time_seconds"]
    assert restart.summary.startswith("the engine restarted") and restart.evidence["started_at"] == 1e9 + 500
    assert "20 s after the engine restarted" in final["engine.iteration_tokens.p95"].summary
    det = _production()  # the same move with no restart window: a warning, as any level never seen
    det.restart_window_s = 0.0
    late = {f.signal: f for f in _restarted(det, restart_at=500, ticks=560)[-1]}
    assert late["engine.iteration_tokens.p95"].severity is Severity.WARNING


def test_the_first_start_time_seen_is_no_restart() -> None:
    det = _production()
    values = {"engine.process_start_time_seconds": 1e9, "engine.requests_running": 1.0}
    assert det.update(Snapshot(0.0, values, {})) == [] and det.restarts_.restarted_at is None


def _one_bin_out(det: GeneralAnomalyDetector, at: int) -> list[object]:
    """Steady noise in [0, 1], then at point ``at`` a value one bin beyond it (novelty score 0.9)."""
    rng = np.random.default_rng(4)
    found: list[object] = []
    for i in range(at + 1):
        value = 1.06 if i == at else float(rng.uniform(0.0, 1.0))
        found = list(det.update(Snapshot(float(i), {"nvml.gpu0.power_watts.mean": value}, {})))
    return found


def test_a_new_pods_first_traffic_is_info_while_its_baselines_settle() -> None:
    """400 s of an idle engine, then traffic: a baseline minutes old has seen none, and a pod that
    starts on a rollout or a scale-out gets exactly this; no warning, but the load's info names it."""
    ticks = _idle_then_busy(_production())
    final = {f.signal: f for f in ticks[-1]}
    assert final and all(f.severity.value == "info" for f in final.values())
    load = final["engine.generation_tokens_per_second"]
    assert load.summary.startswith("the load changed while its baseline settles: ")
    assert load.evidence["settling_points"] == 401
    power = final["nvml.gpu0.power_watts.mean"]
    assert power.evidence.get("with_load") == "engine.generation_tokens_per_second"


def test_a_weak_alarm_while_a_new_baseline_settles_is_info_and_a_warning_once_settled() -> None:
    det = _production()
    det.settle_points = 1000
    [early] = _one_bin_out(det, at=600)
    assert early.score < det.load_threshold  # type: ignore[attr-defined]
    assert early.severity.value == "info" and early.evidence["settling_points"] == 601  # type: ignore[attr-defined]
    assert "while its baseline settles (601 of 1000 points seen)" in early.summary  # type: ignore[attr-defined]
    settled = _production()
    settled.settle_points = 1000
    [late] = _one_bin_out(settled, at=1200)
    assert late.severity.value == "warning" and "settling_points" not in late.evidence  # type: ignore[attr-defined]


def _alarms(det: GeneralAnomalyDetector, series: np.ndarray, name: str) -> list[Finding]:
    key = name.replace(".", "__")
    findings = [f for i, v in enumerate(series) for f in det.update(snap(i * 5.0, **{key: float(v)}))]
    return list({(f.signal, f.since): f for f in findings}.values())


def test_a_new_low_of_a_latency_mean_or_temperature_is_info_and_a_new_high_a_warning() -> None:
    for name, usual in (("engine.ttft_seconds.mean", 0.2), ("nvml.gpu0.temperature_celsius.mean", 60.0)):
        base = np.random.default_rng(0).normal(usual, usual * 0.02, 1500)
        low, high = base.copy(), base.copy()
        low[1400], high[1400] = usual * 0.2, usual * 5
        (fell,) = [f for f in _alarms(detector(settle_points=0), low, name) if f.since == 1400 * 5.0]
        assert fell.severity is Severity.INFO and fell.evidence["usual"] == pytest.approx(usual, rel=0.02)
        assert fell.summary.startswith(f"{name} is unusually low (anomaly score ")
        (rose,) = [f for f in _alarms(detector(settle_points=0), high, name) if f.since == 1400 * 5.0]
        assert rose.severity is Severity.WARNING and "usual" not in rose.evidence


def test_a_new_low_of_another_signal_is_still_a_warning() -> None:
    base = np.random.default_rng(0).normal(0.5, 0.01, 1500)
    base[1400] = 0.1
    (fell,) = [
        f
        for f in _alarms(detector(settle_points=0), base, "engine.kv_cache_usage_ratio")
        if f.since == 1400 * 5.0
    ]
    assert fell.severity is Severity.WARNING
    (kept,) = [
        f
        for f in _alarms(detector(settle_points=0, benign_low=None), base, "engine.kv_cache_usage_ratio")
        if f.since == 1400 * 5.0
    ]
    assert kept.severity is Severity.WARNING


def _served(model_after: str, switch_at: int = 4000, ticks: int = 4060) -> list[list[Finding]]:
    """An engine serving ``qwen3-4b`` for ``switch_at`` ticks (past the hour a baseline settles in), then
    ``model_after`` with its tokens per step at a level never seen (a larger model, other steps)."""
    from detectors.snapshot import Reading, SourceStatus

    det = _production()
    rng = np.random.default_rng(7)
    out = []
    for i in range(ticks):
        model, level = ("qwen3-4b", 64.0) if i < switch_at else (model_after, 256.0)
        values = {"engine.iteration_tokens.p95": level + float(rng.uniform(0, 2))}
        info = {"engine": "vllm", "model": model}
        reading = Reading("engine", float(i), SourceStatus.OK, values, info=info)
        out.append(det.update(Snapshot.from_readings(float(i), {"engine": reading})))
    return out


def test_another_model_has_its_baselines_learned_again() -> None:
    """Baselines learned beside one model judged the next one's levels: each signal warned until its
    window forgot the old model. Now they are learned again, and the move is info while they settle."""
    same = {f.signal: f for f in _served("qwen3-4b")[-1]}
    assert same["engine.iteration_tokens.p95"].severity is Severity.WARNING  # the level alone: a warning
    final = {f.signal: f for f in _served("qwen3-32b")[-1]}
    changed = final["serving_setup"]
    assert changed.severity is Severity.INFO
    assert changed.summary.startswith("this replica now serves with model qwen3-32b (was model qwen3-4b)")
    assert all(f.severity is Severity.INFO for f in final.values())


def test_a_source_silent_for_a_tick_is_no_change_of_setup() -> None:
    from detectors.snapshot import Reading, SourceStatus

    det = _production()
    info = {"engine": "vllm", "model": "qwen3-4b"}
    for i in range(200):
        reading = Reading("engine", float(i), SourceStatus.OK, {"engine.requests_running": 4.0}, info=info)
        if i == 150:  # the engine down a tick: its model unknown
            reading = Reading.failed("engine", float(i), "connection refused")
        det.update(Snapshot.from_readings(float(i), {"engine": reading}))
    assert det.scorers_["engine.requests_running"].n_seen == 199  # type: ignore[attr-defined]
    assert det.setup_.seen == info
