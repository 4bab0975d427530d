import json

from policies import knobs
from policies.arbiter import PRIORITY, Arbiter, ArbiterState, KnobRule
from policies.base import Proposal

ARBITER = Arbiter(
    {knobs.BATCH: KnobRule(8, 256, max_step=0.5, hysteresis=0.05, cooldown_s=10.0, integer=True)}
)


def _p(policy: str, value: float | str, klass: str, knob: str = knobs.BATCH) -> Proposal:
    return Proposal(policy, knob, value, "because", PRIORITY[klass])


def test_breaker_outranks_throughput_tuning():
    _, [d] = ARBITER.decide(
        [_p("auto", 100, "throughput"), _p("breaker", 40, "breaker")], {knobs.BATCH: 64}, None, 0
    )
    assert (d.value, d.policy) == (40, "breaker")


def test_overruled_proposals_are_recorded():
    _, [d] = ARBITER.decide(
        [_p("auto", 100, "throughput"), _p("breaker", 40, "breaker")], {knobs.BATCH: 64}, None, 0
    )
    assert d.overruled == ("auto=100",)


def test_value_is_clamped_to_bounds():
    _, [d] = ARBITER.decide([_p("breaker", 1000, "breaker")], {knobs.BATCH: 200}, None, 0)
    assert d.value == 256 and "bounded" in d.reason


def test_step_is_limited_for_comfort_changes():
    _, [d] = ARBITER.decide([_p("auto", 200, "throughput")], {knobs.BATCH: 64}, None, 0)
    assert d.value == 96


ARBITER_NARROW = Arbiter({knobs.BATCH: KnobRule(8, 32, max_step=0.5, integer=True)})


def test_a_value_in_force_outside_the_bounds_reaches_the_nearest_bound_in_one_move():
    """Bounds narrowed by a config reload: the step limit would stop at 128, still outside [8, 32]."""
    _, [down] = ARBITER_NARROW.decide([_p("auto", 16, "throughput")], {knobs.BATCH: 256}, None, 0)
    assert down.value == 32 and down.reason.endswith("; outside [8, 32]: to the nearest bound at once")
    _, [up] = ARBITER_NARROW.decide([_p("auto", 30, "throughput")], {knobs.BATCH: 4}, None, 0)
    assert up.value == 8 and "step limited" not in up.reason
    _, [inside] = ARBITER_NARROW.decide([_p("auto", 8, "throughput")], {knobs.BATCH: 30}, None, 0)
    assert inside.value == 15 and inside.reason.endswith("; step limited to 50%")


def test_change_within_hysteresis_is_dropped():
    assert ARBITER.decide([_p("auto", 66, "throughput")], {knobs.BATCH: 64}, None, 0)[1] == []


def test_cooldown_blocks_a_second_comfort_change():
    state = ArbiterState({knobs.BATCH: 0.0})
    assert ARBITER.decide([_p("auto", 32, "throughput")], {knobs.BATCH: 64}, state, 5.0)[1] == []


def test_breaker_ignores_the_cooldown():
    state = ArbiterState({knobs.BATCH: 0.0})
    assert len(ARBITER.decide([_p("breaker", 32, "breaker")], {knobs.BATCH: 64}, state, 5.0)[1]) == 1


def test_same_value_makes_no_decision():
    assert ARBITER.decide([_p("auto", 64, "throughput")], {knobs.BATCH: 64}, None, 0)[1] == []


def test_categorical_knob_changes_with_reason():
    _, [d] = ARBITER.decide(
        [_p("breaker", "fp8", "breaker", knobs.UPSTREAM)], {knobs.UPSTREAM: "primary"}, None, 0
    )
    assert (d.value, d.previous) == ("fp8", "primary") and d.reason.startswith("breaker:")


def test_decision_records_when_the_knob_changed():
    state, _ = ARBITER.decide([_p("auto", 32, "throughput")], {knobs.BATCH: 64}, None, 7.0)
    assert state.changed_at[knobs.BATCH] == 7.0


def test_linked_routing_knobs_let_only_the_higher_class_stand():
    """route.upstream and route.fp8_share both set the gate's split: a calm breaker giving routing back
    (throughput class) yields to a canary's share (SLO guard); a tripped breaker (breaker class) wins."""
    canary = _p("canary", 0.25, "slo_guard", knobs.FP8_SHARE)
    actual = {knobs.FP8_SHARE: 0.05}
    _, decisions = ARBITER.decide(
        [_p("breaker", "primary", "throughput", knobs.UPSTREAM), canary], actual, None, 0
    )
    assert [(d.knob, d.value) for d in decisions] == [(knobs.FP8_SHARE, 0.25)]
    assert decisions[0].overruled == ("breaker:route.upstream=primary",)
    _, decisions = ARBITER.decide([_p("breaker", "fp8", "breaker", knobs.UPSTREAM), canary], actual, None, 0)
    assert [(d.knob, d.value) for d in decisions] == [(knobs.UPSTREAM, "fp8")]
    assert decisions[0].overruled == ("canary:route.fp8_share=0.25",)


def test_unlinked_knobs_are_decided_each_on_its_own():
    proposals = [_p("breaker", 32, "breaker"), _p("canary", 0.25, "slo_guard", knobs.FP8_SHARE)]
    _, decisions = ARBITER.decide(proposals, {knobs.BATCH: 64, knobs.FP8_SHARE: 0.0}, None, 0)
    assert sorted(d.knob for d in decisions) == [knobs.BATCH, knobs.FP8_SHARE]


def test_an_integer_knob_is_decided_as_an_int():
    """The audit log and advise mode show the decided value: ``48``, not ``48.0``, for a batch size."""
    _, [d] = ARBITER.decide([_p("breaker", 47.6, "breaker")], {knobs.BATCH: 64}, None, 0)
    assert d.value == 48 and type(d.value) is int
    assert '"value": 48,' in json.dumps(d.to_json())
