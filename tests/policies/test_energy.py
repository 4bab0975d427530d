import pytest

from policies import knobs
from policies.arbiter import PRIORITY
from policies.energy import Energy, EnergyState
from policies.schedule import Schedule
from tests.policies.conftest import make_snapshot

LEVELS = (1400.0, 1200.0, 1000.0, 800.0)
POLICY = Energy(ttft_slo_s=10.0, itl_slo_s=0.1, levels_mhz=LEVELS, dwell_s=30.0)
SLACK = {"engine__itl_seconds__mean": 0.02, "engine__ttft_seconds__p99": 1.0, "engine__requests_waiting": 0.0}
RISK = {"engine__itl_seconds__mean": 0.12, "engine__ttft_seconds__p99": 1.0, "engine__requests_waiting": 0.0}


def _decide(state: EnergyState | None, now: float, **values: float):
    return POLICY.decide(make_snapshot(now, **values), [], state, now)


def test_slack_for_the_dwell_lowers_one_level():
    state, proposals = _decide(EnergyState(0, 0.0), 31.0, **SLACK)
    assert state.level == 1 and proposals[0].value == 1200.0


def test_slack_shorter_than_the_dwell_holds():
    state, _ = _decide(EnergyState(0, 0.0), 10.0, **SLACK)
    assert state.level == 0


def test_latency_risk_climbs_two_levels_at_once():
    state, proposals = _decide(EnergyState(3, None), 0.0, **RISK)
    assert state.level == 1 and proposals[0].value == 1200.0


def test_restoring_outranks_energy_saving():
    _, proposals = _decide(EnergyState(3, None), 0.0, **RISK)
    assert proposals[0].priority == PRIORITY["slo_guard"]


def test_missing_latency_signal_runs_full_clock():
    state, proposals = _decide(EnergyState(2, None), 0.0)
    assert state.level == 0 and proposals[0].value == 1400.0


def test_lowest_level_is_the_floor():
    state, _ = _decide(EnergyState(3, 0.0), 100.0, **SLACK)
    assert state.level == 3


def test_peak_window_forces_full_clock():
    schedule = Schedule.from_data(
        {"timezone": "UTC", "windows": [{"start": "00:00", "end": "24:00", "mode": "peak"}]}
    )
    policy = Energy(10.0, 0.1, LEVELS, schedule=schedule)
    _, proposals = policy.decide(make_snapshot(0.0, **SLACK), [], EnergyState(3, None), 0.0)
    assert proposals[0].value == 1400.0


def test_proposes_the_clock_knob():
    _, proposals = _decide(None, 0.0, **SLACK)
    assert proposals[0].knob == knobs.SM_CLOCK


def test_levels_must_descend():
    with pytest.raises(ValueError, match="sorted"):
        Energy(10.0, 0.1, (800.0, 1400.0))


def test_a_queue_alone_neither_raises_nor_holds_the_clock():
    """A burst that queues requests while TTFT and ITL are inside the SLO: the slack dwell still counts."""
    queued = {**SLACK, "engine__requests_waiting": 40.0}
    state, proposals = _decide(EnergyState(2, 0.0), 31.0, **queued)
    assert state.level == 3 and proposals[0].value == 800.0
    assert proposals[0].priority == PRIORITY["energy"]


def test_the_ttft_tail_climbs():
    late = {**SLACK, "engine__ttft_seconds__p99": 10.5}
    state, proposals = _decide(EnergyState(3, None), 0.0, **late)
    assert state.level == 1 and proposals[0].priority == PRIORITY["slo_guard"]


def _feed(verdicts: list[tuple[float, float, float]], state: EnergyState | None = None):
    """Ticks of (now, answers, missed) with slack latency signals; the last state and proposals."""
    proposals = []
    for now, answers, missed in verdicts:
        state, proposals = _decide(state, now, **SLACK, gate__requests=answers, gate__slo_bad=missed)
    assert state is not None
    return state, proposals


def test_the_gates_verdicts_climb_the_ladder_while_the_mean_itl_has_room():
    """The engine's mean ITL has room, but 5% of the answers miss their own (class) targets."""
    start = EnergyState(3, None)
    state, proposals = _feed([(t, 10.0, 0.5) for t in range(0, 40, 1)], start)
    assert state.level < 3 and proposals[0].priority == PRIORITY["slo_guard"]
    assert "missed their targets" in proposals[0].reason


def test_misses_between_half_and_the_limit_hold_the_clock():
    state, proposals = _feed([(t, 10.0, 0.15) for t in range(0, 100, 1)], EnergyState(1, None))
    assert state.level == 1 and "hold" in proposals[0].reason


def test_few_answers_or_old_misses_say_nothing():
    # a quiet night: 2 answers a minute, all missed, are too few to hold the clock up
    quiet, _ = _feed([(t, 1.0 if t % 30 == 0 else 0.0, 1.0 if t % 30 == 0 else 0.0) for t in range(0, 200)])
    assert quiet.level >= 3
    # a burst of misses a few minutes ago is out of the window: the ladder descends again
    state, _ = _feed([(t, 10.0, 5.0 if t < 20 else 0.0) for t in range(0, 200)])
    assert state.level >= 2


def test_a_small_class_missing_its_targets_climbs_though_the_pod_meets_its_own():
    """High is a tenth of the answers and misses a fifth of them: 2% of the pod's, not over the 2% limit,
    but 20% of the class's over its 5-minute window."""
    state: EnergyState | None = EnergyState(3, None)
    proposals = []
    for now in range(0, 120):
        values = {**SLACK, "gate__requests": 10.0, "gate__slo_bad": 0.2}
        values |= {"gate__class__high__requests": 1.0, "gate__class__high__slo_bad": 0.2}
        values |= {"gate__class__normal__requests": 9.0, "gate__class__normal__slo_bad": 0.0}
        state, proposals = POLICY.decide(make_snapshot(float(now), **values), [], state, float(now))
    assert state is not None and state.level < 3
    assert "of the high class's answers missed their targets" in proposals[0].reason
