from policies import knobs
from policies.canary import PPL_FP8, PPL_PRIMARY, Canary, CanaryState
from tests.policies.conftest import make_snapshot

CANARY = Canary(step_s=60.0, gate_timeout_s=100.0, failure_limit=1)
HEALTHY = {"gate__requests": 20.0, "gate__slo_bad": 0.0, "gate__errors": 0.0}
BAD = {"gate__requests": 20.0, "gate__slo_bad": 10.0, "gate__errors": 0.0}


def _ppl(primary: float, fp8: float) -> dict[str, float]:
    return {PPL_PRIMARY.replace(".", "__"): primary, PPL_FP8.replace(".", "__"): fp8}


def _rolling(step: int = 0, at: float = 0.0) -> CanaryState:
    return CanaryState("rolling", step, at, 0, "")


def test_small_perplexity_delta_opens_the_first_step():
    state, proposals = CANARY.decide(
        make_snapshot(1.0, **_ppl(10.0, 10.04)), [], CANARY.start(None, 0.0), 1.0
    )
    assert state.phase == "rolling" and proposals[0].value == 0.05


def test_perplexity_delta_at_the_limit_refuses_fp8():
    state, proposals = CANARY.decide(
        make_snapshot(1.0, **_ppl(10.0, 10.05)), [], CANARY.start(None, 0.0), 1.0
    )
    assert state.phase == "rolled_back" and proposals[0].value == 0.0


def test_missing_perplexity_past_the_timeout_rolls_back():
    state, _ = CANARY.decide(make_snapshot(150.0), [], CANARY.start(None, 0.0), 150.0)
    assert state.phase == "rolled_back"


def test_healthy_step_advances_after_step_time():
    state, proposals = CANARY.decide(make_snapshot(61.0, **HEALTHY), [], _rolling(0), 61.0)
    assert (state.step, proposals[0].value) == (1, 0.25)


def test_healthy_step_holds_before_step_time():
    state, _ = CANARY.decide(make_snapshot(30.0, **HEALTHY), [], _rolling(0), 30.0)
    assert state.step == 0


def test_last_step_promotes_to_full_traffic():
    state, proposals = CANARY.decide(make_snapshot(61.0, **HEALTHY), [], _rolling(3), 61.0)
    assert state.phase == "promoted" and proposals[0].value == 1.0


def test_failures_beyond_the_limit_roll_back_to_zero():
    state = _rolling(2)
    for t in (1.0, 2.0):
        state, proposals = CANARY.decide(make_snapshot(t, **BAD), [], state, t)
    assert state.phase == "rolled_back" and proposals[0].value == 0.0


def test_missing_metrics_count_as_a_failure():
    state, _ = CANARY.decide(make_snapshot(1.0), [], _rolling(1), 1.0)
    assert state.failures == 1


def test_idle_canary_proposes_nothing():
    assert CANARY.decide(make_snapshot(0.0), [], None, 0.0)[1] == []


def test_proposes_the_fp8_share_knob():
    _, proposals = CANARY.decide(make_snapshot(1.0, **HEALTHY), [], _rolling(0), 1.0)
    assert proposals[0].knob == knobs.FP8_SHARE
