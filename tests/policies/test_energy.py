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
