import pytest

from policies.arbiter import PRIORITY
from policies.knobs import QUEUE_WAIT
from policies.queue_deadline import QueueDeadline
from policies.registry import build_set, default_arbiter
from tests.policies.conftest import make_snapshot

POLICY = QueueDeadline(ttft_slo_s=10.0)


def _decide(state: float | None = None, **values: float) -> tuple[float | None, list[float]]:
    new_state, proposals = POLICY.decide(make_snapshot(**values), [], state, 100.0)
    assert all(p.knob == QUEUE_WAIT and p.priority == PRIORITY["slo_guard"] for p in proposals)
    return new_state, [float(p.value) for p in proposals]


def test_admitted_requests_late_shorten_the_deadline_by_the_gain_times_the_excess():
    # p99 12 s against a 9.5 s target: 10 + 0.25 * (9.5 - 12) = 9.375
    assert _decide(**{"gate__max_queue_wait_s": 10.0, "engine__ttft_seconds__p99": 12.0}) == (9.375, [9.375])


def test_a_short_queue_brings_the_deadline_back_to_the_slo_and_no_further():
    assert _decide(**{"gate__max_queue_wait_s": 8.0, "engine__ttft_seconds__p99": 0.4})[1] == [10.0]
    assert _decide(**{"gate__max_queue_wait_s": 9.8, "engine__ttft_seconds__p99": 0.4})[1] == [10.0]
    assert _decide(**{"gate__max_queue_wait_s": 10.0, "engine__ttft_seconds__p99": 0.4})[1] == []


def test_never_below_the_floor_of_80_percent_of_the_slo():
    assert _decide(**{"gate__max_queue_wait_s": 8.5, "engine__ttft_seconds__p99": 60.0})[1] == [8.0]
    assert _decide(**{"gate__max_queue_wait_s": 8.0, "engine__ttft_seconds__p99": 60.0})[1] == []


def test_the_reason_names_the_bound_when_the_bound_made_the_move():
    """Seen live: a configured 5 s wait under a 2 s SLO was cut with "TTFT p99 0.01s over 1.90s"."""

    def reason(wait: float, ttft: float) -> tuple[float, str]:
        snapshot = make_snapshot(gate__max_queue_wait_s=wait, engine__ttft_seconds__p99=ttft)
        [proposal] = POLICY.decide(snapshot, [], None, 1.0)[1]
        return float(proposal.value), proposal.reason

    cut, why = reason(30.0, 0.01)
    assert cut == 10.0 and "past the TTFT SLO 10s" in why and "over" not in why
    raised, why = reason(2.0, 60.0)
    assert raised == 8.0 and "under the floor 80% of the TTFT SLO" in why
    assert "TTFT p99 12.00s over 9.50s" in reason(10.0, 12.0)[1]


def test_small_moves_are_not_proposed():
    state, proposals = _decide(**{"gate__max_queue_wait_s": 9.0, "engine__ttft_seconds__p99": 9.2})
    assert proposals == [] and state == 9.0


def test_no_first_token_in_the_window_holds_and_state_stands_in_for_the_knob():
    assert _decide(state=9.0) == (9.0, [])
    assert _decide(state=9.0, engine__ttft_seconds__p99=12.0) == (8.375, [8.375])


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        QueueDeadline(0.0)
    with pytest.raises(ValueError):
        QueueDeadline(10.0, floor_share=0.99, target_share=0.9)
    with pytest.raises(ValueError):
        QueueDeadline(10.0, gain=0.0)


def test_auto_has_it_only_with_a_gate_and_the_arbiter_bounds_it():
    names = [p.name for p in build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1, queue_deadline=True)]
    assert "queue_deadline" in names
    assert "queue_deadline" not in [p.name for p in build_set("auto", ttft_slo_s=10.0, itl_slo_s=0.1)]
    assert QUEUE_WAIT in default_arbiter().rules
