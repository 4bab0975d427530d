"""EngineStallDetector: requests held with nothing moving is a hung engine; quiet or lumpy is not."""

from __future__ import annotations

import pytest

from detectors.base import Finding, Severity
from detectors.snapshot import Reading, Snapshot, SourceStatus
from detectors.stall import EngineStallDetector


def _snap(now: float, **values: float) -> Snapshot:
    flat = {f"engine.{name}": value for name, value in values.items()}
    return Snapshot.from_readings(now, {"engine": Reading("engine", now, SourceStatus.OK, flat)})


def _run(detector: EngineStallDetector, ticks: list[Snapshot]) -> list[list[Finding]]:
    return [detector.update(s) for s in ticks]


def test_requests_held_with_no_token_for_a_minute_is_a_critical_finding() -> None:
    detector = EngineStallDetector()
    busy = [_snap(t, requests_running=3, generation_tokens_per_second=900) for t in range(0, 10)]
    hung = [_snap(t, requests_running=3, generation_tokens_per_second=0) for t in range(10, 80)]
    found = _run(detector, busy + hung)
    first = next(i for i, f in enumerate(found) if f)
    assert first == 69  # the last progress was at t = 9; t = 69 is 60 s later
    [finding] = found[-1]
    assert finding.severity is Severity.CRITICAL and finding.since == 9.0
    assert finding.summary == "engine stalled: 3 request(s) held, no progress for 70s"
    assert finding.evidence == {"requests_held": 3, "seconds_without_progress": 70.0}
    # tokens again: over at once
    assert detector.update(_snap(80, requests_running=3, generation_tokens_per_second=5)) == []


def test_an_idle_engine_is_not_stalled() -> None:
    detector = EngineStallDetector()
    ticks = [
        _snap(t, requests_running=0, requests_waiting=0, generation_tokens_per_second=0) for t in range(300)
    ]
    assert not any(_run(detector, ticks))


def test_requests_waiting_with_none_running_and_nothing_moving_is_a_stall() -> None:
    """A scheduler that stopped admitting: the queue holds requests and nothing runs."""
    detector = EngineStallDetector(stall_s=30)
    ticks = [
        _snap(t, requests_running=0, requests_waiting=5, generation_tokens_per_second=0) for t in range(40)
    ]
    assert _run(detector, ticks)[-1][0].evidence["requests_held"] == 5


def test_a_counter_that_moves_only_when_requests_finish_is_not_a_stall_while_gauges_move() -> None:
    """SGLang counts tokens when a request finishes: four long generations move no counter for minutes,
    but its throughput gauge is recomputed every few dozen decode steps. Frozen, it is a stall."""
    detector = EngineStallDetector()
    decoding = [
        _snap(
            t,
            requests_running=4,
            generation_tokens_per_second=0,
            reported_generation_tokens_per_second=120 + t % 7,
        )
        for t in range(0, 300)
    ]
    assert not any(_run(detector, decoding))
    frozen = [
        _snap(
            t, requests_running=4, generation_tokens_per_second=0, reported_generation_tokens_per_second=125
        )
        for t in range(300, 370)
    ]
    assert _run(detector, frozen)[-1]


def test_llama_cpp_decode_steps_are_progress() -> None:
    detector = EngineStallDetector()
    ticks = [
        _snap(t, requests_running=1, generation_tokens_per_second=0, decode_steps_per_second=30)
        for t in range(200)
    ]
    assert not any(_run(detector, ticks))


def test_answers_through_the_gate_are_not_this_engines_progress() -> None:
    """With a canary or a fallback upstream, the gate answers from another engine while this one hangs."""
    detector = EngineStallDetector()
    ticks = [
        Snapshot.from_readings(
            float(t),
            {
                "engine": Reading("engine", t, SourceStatus.OK, {"engine.requests_running": 2.0}),
                "gate": Reading("gate", t, SourceStatus.OK, {"gate.requests": 5.0}),
            },
        )
        for t in range(70)
    ]
    assert _run(detector, ticks)[-1]


def _with_gate(t: float, unanswered: float, **engine: float) -> Snapshot:
    flat = {f"engine.{name}": value for name, value in engine.items()}
    return Snapshot.from_readings(
        t,
        {
            "engine": Reading("engine", t, SourceStatus.OK, flat),
            "gate": Reading("gate", t, SourceStatus.OK, {"gate.engine_unanswered": unanswered}),
        },
    )


def test_requests_the_gate_sent_that_the_engine_does_not_count_are_held() -> None:
    """vLLM with its engine core hung while idle: 0 running, 0 waiting and nothing moving, while two
    requests the gate sent it wait in its API server, with no byte back. Stalled, 60 s on; and an engine
    the gate holds nothing at is idle, not stalled."""
    still = {"requests_running": 0.0, "requests_waiting": 0.0, "generation_tokens_per_second": 0.0}
    found = _run(EngineStallDetector(), [_with_gate(float(t), 2.0, **still) for t in range(70)])
    assert next(i for i, f in enumerate(found) if f) == 60
    assert found[-1][0].summary == "engine stalled: 2 request(s) held, no progress for 69s"
    idle = _run(EngineStallDetector(), [_with_gate(float(t), 0.0, **still) for t in range(300)])
    assert not any(idle)


def test_a_tick_without_the_engine_neither_starts_nor_ends_a_stall() -> None:
    """A failed scrape is the engine-down alert's case; it must not hide a stall that was under way."""
    detector = EngineStallDetector()
    hung = [_snap(t, requests_running=2, generation_tokens_per_second=0) for t in range(0, 40)]
    missing = [Snapshot.from_readings(float(t), {}) for t in range(40, 70)]
    found = _run(detector, hung + missing)
    assert not any(found)  # no verdict without a reading
    [finding] = detector.update(_snap(70, requests_running=2, generation_tokens_per_second=0))
    assert finding.since == 0.0  # the episode that began at t = 0 goes on


def test_stall_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_s must be > 0, got 0"):
        EngineStallDetector(stall_s=0)


def _stalled_with_gpus(utils: list[float]) -> Finding:
    """A 61 s stall whose last tick has NVML readings with these per-GPU utilisations."""
    detector = EngineStallDetector()
    for t in range(61):
        detector.update(_snap(t, requests_running=2, generation_tokens_per_second=0))
    flat = {f"nvml.gpu{i}.utilization_ratio.mean": u for i, u in enumerate(utils)}
    snapshot = Snapshot.from_readings(
        61,
        {
            "engine": Reading("engine", 61, SourceStatus.OK, {"engine.requests_running": 2}),
            "nvml": Reading("nvml", 61, SourceStatus.OK, flat),
        },
    )
    [finding] = detector.update(snapshot)
    return finding


@pytest.mark.parametrize(
    "utils, evidence, says",
    [
        ([1.0, 0.97], {"gpus_busy": "0,1"}, "Its GPUs read busy while nothing progresses"),
        ([0.0, 0.01], {"gpus_idle": "0,1"}, "Its GPUs are idle: nothing was launched"),
        (
            [1.0, 0.0, 1.0, 1.0],
            {"gpus_busy": "0,2,3", "gpus_idle": "1"},
            "GPU(s) 0,2,3 read busy while GPU(s) 1 are idle",
        ),
        ([1.0, 0.5], {"gpus_busy": "0"}, "A hung collective (NCCL; one tensor-parallel rank lost)"),
        ([], {}, "A hung collective (NCCL; one tensor-parallel rank lost)"),
    ],
)
def test_what_the_gpus_read_during_a_stall_picks_the_hint(
    utils: list[float], evidence: dict[str, str], says: str
) -> None:
    """The first question in a hang: a collective spinning on a lost rank (GPUs busy, the lost one idle)
    or a stuck host (GPUs idle). The finding says which the GPUs show, and names the suspects."""
    finding = _stalled_with_gpus(utils)
    assert {k: v for k, v in finding.evidence.items() if k.startswith("gpus_")} == evidence
    assert says in finding.hint, finding.hint
    assert finding.hint.endswith("the Service sends new requests to other replicas.")


def test_a_gap_with_no_tick_at_all_restarts_the_count() -> None:
    """The sidecar unscheduled for 71 s (a node stall, a paused VM) saw nothing in the gap, and the engine
    on the same node was paused with it: the first frozen reading after it is not 71 s of stillness."""
    detector = EngineStallDetector()
    before = [_snap(t, requests_running=2, generation_tokens_per_second=0) for t in range(0, 40)]
    after = [_snap(t, requests_running=2, generation_tokens_per_second=0) for t in range(110, 180)]
    ticks = before + after
    found = _run(detector, ticks)
    first = next(i for i, f in enumerate(found) if f)
    assert ticks[first].now == 170  # 60 watched seconds after the first tick past the gap
    assert found[first][0].since == 110.0


def test_a_short_gap_inside_a_stall_does_not_hide_it() -> None:
    """A gap under half of ``stall_s`` is not blind: the stall under way is found when it is due."""
    detector = EngineStallDetector()
    hung = [_snap(t, requests_running=2, generation_tokens_per_second=0) for t in (*range(0, 40), 60)]
    found = _run(detector, hung)
    [finding] = found[-1]
    assert finding.since == 0.0 and finding.evidence["seconds_without_progress"] == 60.0


def test_a_long_tick_interval_is_not_a_blind_gap() -> None:
    """With ``agent.interval_s`` at 60 s every gap is a minute: the usual gap, so still a stall."""
    detector = EngineStallDetector()
    found = _run(detector, [_snap(t, requests_running=2) for t in (0, 60, 120, 180)])
    assert [bool(f) for f in found] == [False, True, True, True]
    # and a gap far beyond the usual minute is blind again
    assert detector.update(_snap(600, requests_running=2)) == []
