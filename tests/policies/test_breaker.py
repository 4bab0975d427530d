"""The breaker under injected faults: escalation and recovery order, dwell, probes, generations, force."""

import itertools
from collections.abc import Callable

import pytest

from policies import knobs
from policies.arbiter import PRIORITY
from policies.breaker import TRANSITIONS, Breaker, BreakerState
from tests.policies.conftest import make_snapshot

BREAKER = Breaker(dwell_s=300.0, probe_s=120.0)
GIB = 1024**3


def _healthy(t: float) -> dict[str, float]:
    return {"gate__requests": 10.0, "gate__slo_bad": 0.0, "gate__errors": 0.0, "gate__limit": 128.0}


def _latency_spike(t: float) -> dict[str, float]:
    return {**_healthy(t), "gate__slo_bad": 6.0}


def _error_storm(t: float) -> dict[str, float]:
    return {**_healthy(t), "gate__slo_bad": 5.0, "gate__errors": 5.0}  # min_bad in one tick: trips at once


def _leak(t: float) -> dict[str, float]:
    return {
        **_healthy(t),
        "nvml__gpu0__memory_used_bytes": 79.5 * GIB,
        "nvml__gpu0__memory_total_bytes": 80 * GIB,
    }


def _run(
    fault: Callable[[float], dict[str, float]], fault_s: float, total_s: float, breaker: Breaker = BREAKER
) -> list[tuple[float, int]]:
    """Tick once a second; the fault holds for the first ``fault_s``. Returns (time, level) at each change."""
    state: BreakerState | None = None
    changes: list[tuple[float, int]] = []
    level = 0
    for t in range(int(total_s)):
        values = fault(t) if t < fault_s else _healthy(t)
        state, proposals = breaker.decide(make_snapshot(float(t), **values), [], state, float(t))
        routes = {p.value for p in proposals if p.knob == knobs.UPSTREAM}
        assert routes <= {
            "primary",
            *(("fp8",) if 2 in breaker.levels else ()),
            *(("small",) if 3 in breaker.levels else ()),
        }
        if state.level != level:
            level = state.level
            changes.append((float(t), level))
    return changes


@pytest.mark.parametrize("fault", [_latency_spike, _error_storm, _leak], ids=["latency", "5xx", "leak"])
def test_fault_escalates_one_level_at_a_time_then_recovers_in_reverse(fault):
    changes = _run(fault, fault_s=1200.0, total_s=4000.0)
    assert [level for _, level in changes] == [1, 2, 3, 2, 1, 0]


@pytest.mark.parametrize("fault", [_latency_spike, _error_storm, _leak], ids=["latency", "5xx", "leak"])
def test_level_changes_at_most_once_per_dwell(fault):
    times = [t for t, _ in _run(fault, fault_s=1200.0, total_s=4000.0)]
    assert all(b - a >= BREAKER.dwell_s for a, b in itertools.pairwise(times))


def test_short_fault_escalates_once_and_recovers():
    changes = _run(_latency_spike, fault_s=500.0, total_s=2000.0)
    assert [level for _, level in changes] == [1, 0]


def _slow_burn(t: float) -> dict[str, float]:
    return {**_healthy(t), "gate__slo_bad": 1.0}  # 10% bad: 10x, a slow burn and no fast one


@pytest.mark.parametrize(
    ("fault", "first_trip_s"), [(_latency_spike, 300.0), (_slow_burn, 1800.0)], ids=["fast", "slow"]
)
def test_a_fresh_breaker_trips_on_a_burn_only_after_seeing_its_short_window(fault, first_trip_s):
    """Until the sidecar has seen 5 m (30 m) of answers, the fast (slow) burn's long window is no longer
    than its short one. A new pod's first minutes at 10% bad took it to L1 on 3 minutes of data, where a
    warm sidecar counts the same minutes against its hour and six hours (the Mooncake replay, 202 s)."""
    changes = _run(fault, fault_s=4000.0, total_s=first_trip_s + 1.0)
    assert changes == [(first_trip_s, 1)]


def test_a_burn_after_warm_hours_is_judged_over_them():
    """A 400 s spike trips a fresh breaker at 300 s; after two healthy hours the same minutes are a small
    share of the long windows (b(1 h) = 0.6 x 400 / 3600 / 1% = 6.7x, b(6 h) 3.2x): no trip."""
    assert _run(_latency_spike, fault_s=400.0, total_s=1000.0)[0] == (300.0, 1)

    def spike_after_two_hours(t: float) -> dict[str, float]:
        return _latency_spike(t) if 7200 <= t < 7600 else _healthy(t)

    assert _run(spike_after_two_hours, fault_s=9000.0, total_s=9000.0) == []


def test_healthy_traffic_never_trips():
    assert _run(_healthy, fault_s=0.0, total_s=2000.0) == []


def test_escalation_starts_a_new_generation():
    state, _ = BREAKER.decide(make_snapshot(0.0, **_error_storm(0)), [], None, 0.0)
    assert (state.level, state.generation) == (1, 1)


def test_stale_outcomes_of_the_previous_generation_do_not_escalate():
    """After a change, the 5 m burn only counts outcomes since it: clean traffic does not trip again."""
    state = None
    for t in range(0, 200):
        state, _ = BREAKER.decide(make_snapshot(float(t), **_latency_spike(t)), [], state, float(t))
    for t in range(200, 700):
        state, _ = BREAKER.decide(make_snapshot(float(t), **_healthy(t)), [], state, float(t))
    assert state.level <= 1


def test_failed_probe_returns_up_and_doubles_the_dwell():
    state = BreakerState(level=1, phase="probe", generation=3, changed_at=0.0, dwell_s=300.0, batch_cap=32.0)
    state, _ = BREAKER.decide(make_snapshot(10.0, **_error_storm(10)), [], state, 10.0)
    assert (state.level, state.phase, state.dwell_s) == (2, "steady", 600.0)


def test_probe_is_committed_after_probe_time():
    state = BreakerState(level=1, phase="probe", generation=3, changed_at=0.0, dwell_s=300.0, batch_cap=32.0)
    state, _ = BREAKER.decide(make_snapshot(130.0, **_healthy(130)), [], state, 130.0)
    assert (state.level, state.phase) == (1, "steady")


def test_forced_level_is_held_against_healthy_signals():
    state = BREAKER.force(None, 2, now=0.0)
    for t in range(0, 2000, 10):
        state, proposals = BREAKER.decide(make_snapshot(float(t), **_healthy(t)), [], state, float(t))
    assert state.level == 2 and {p.value for p in proposals if p.knob == knobs.UPSTREAM} == {"fp8"}


def test_force_rejects_unknown_level():
    with pytest.raises(ValueError, match="level"):
        BREAKER.force(None, 4, now=0.0)


@pytest.mark.parametrize(
    ("levels", "path"),
    [((0, 1), [1, 0]), ((0, 1, 3), [1, 3, 1, 0]), ((0, 1, 2), [1, 2, 1, 0])],
    ids=["primary only", "no fp8", "no small"],
)
def test_a_gate_without_some_upstreams_skips_their_levels(levels, path):
    """A long 5xx storm: the breaker climbs only through the levels this gate can route, never proposing
    an upstream it does not have (each tick's proposals are checked in _run), and comes back the same way."""
    breaker = Breaker(dwell_s=300.0, probe_s=120.0, levels=levels)
    assert [level for _, level in _run(_error_storm, 1200.0, 4000.0, breaker)] == path


def test_a_breaker_with_nowhere_to_route_proposes_no_route():
    """Levels 0-1 (no gate, or a gate with primary alone): L1 still caps the batch, but no route.upstream."""
    breaker = Breaker(levels=(0, 1))
    for state in (None, BreakerState(level=1, dwell_s=300.0, changed_at=0.0, batch_cap=32.0)):
        _, proposals = breaker.decide(make_snapshot(0.0, **_healthy(0)), [], state, 0.0)
        assert knobs.UPSTREAM not in {p.knob for p in proposals}
    assert [p.knob for p in proposals] == [knobs.BATCH]


def test_unusable_levels_are_refused_and_a_restored_one_steps_down():
    breaker = Breaker(levels=(0, 1, 3))
    with pytest.raises(ValueError, match="must be one of 0, 1, 3"):
        breaker.force(None, 2, now=0.0)
    # saved by a sidecar whose gate had an fp8 upstream; this one has none
    state, proposals = breaker.decide(
        make_snapshot(0.0, **_healthy(0)), [], BreakerState(level=2, forced=2, dwell_s=300.0), 0.0
    )
    assert (state.level, state.forced) == (1, None)
    assert {p.value for p in proposals if p.knob == knobs.UPSTREAM} == {"primary"}
    for bad in [(), (1, 2), (0, 2, 1), (0, 4)]:
        with pytest.raises(ValueError, match="levels"):
            Breaker(levels=bad)


def test_only_levels_two_and_three_route_with_the_breakers_authority():
    """L0/L1 give routing back at the lowest class (a canary's fp8 share outranks it); L2/L3 take it."""
    for level, route, klass in (
        (0, "primary", "throughput"),
        (1, "primary", "throughput"),
        (2, "fp8", "breaker"),
    ):
        state = BreakerState(level=level, changed_at=0.0, dwell_s=300.0, batch_cap=64.0)
        _, proposals = BREAKER.decide(make_snapshot(0.0, **_healthy(0)), [], state, 0.0)
        [proposal] = [p for p in proposals if p.knob == knobs.UPSTREAM]
        assert (proposal.value, proposal.priority) == (route, PRIORITY[klass])


def test_a_gate_splitting_over_replicas_gets_its_configured_split_back_not_primary():
    breaker = Breaker(normal_route=knobs.DEFAULT_ROUTE)
    _, proposals = breaker.decide(make_snapshot(0.0, **_healthy(0)), [], None, 0.0)
    assert [p.value for p in proposals if p.knob == knobs.UPSTREAM] == [knobs.DEFAULT_ROUTE]


def test_a_level_forced_up_from_l0_halves_the_batch_like_a_trip_not_to_the_floor():
    """Forcing L3 from L0 cut the gate's 64 to the floor (8) in a live run: 57% of requests got 503."""
    snapshot = make_snapshot(0.0, **_healthy(0), **{knobs.GATE_LIMIT: 64.0})
    for level in (1, 3):
        state = BREAKER.force(None, level, now=0.0)
        state, proposals = BREAKER.decide(snapshot, [], state, 0.0)
        assert {p.knob: p.value for p in proposals}[knobs.BATCH] == 32, level
        back = BREAKER.force(state, 0, now=1.0)  # forced back down: no cap left to reuse later
        assert back.batch_cap is None


def test_level_two_routes_to_fp8_with_a_smaller_batch():
    state = BreakerState(level=2, changed_at=0.0, dwell_s=300.0, batch_cap=64.0)
    _, proposals = BREAKER.decide(make_snapshot(0.0, **_healthy(0)), [], state, 0.0)
    assert {p.knob: p.value for p in proposals} == {knobs.UPSTREAM: "fp8", knobs.BATCH: 64}


def test_l1_caps_the_batch_at_half_the_limit():
    _state, proposals = BREAKER.decide(make_snapshot(0.0, **_error_storm(0)), [], None, 0.0)
    assert {p.knob: p.value for p in proposals}[knobs.BATCH] == 64


def test_l1_never_raises_a_limit_already_below_its_floor():
    """A limit of 4 (under the floor of 8) stays 4 at L1; 12 is cut to the floor, not to 6."""
    for limit, cap in ((4.0, 4), (12.0, 8), (128.0, 64)):
        values = {**_error_storm(0), knobs.GATE_LIMIT: limit}
        _state, proposals = BREAKER.decide(make_snapshot(0.0, **values), [], None, 0.0)
        assert {p.knob: p.value for p in proposals}[knobs.BATCH] == cap, limit


def test_transition_table_covers_every_phase_and_event():
    assert set(TRANSITIONS) == {(p, e) for p in ("steady", "probe") for e in ("trip", "healthy")}


#: The breaker as the auto set builds it: it knows the inter-token SLO.
QUEUE_AWARE = Breaker(dwell_s=300.0, probe_s=120.0, itl_slo_s=0.1)


def _queueing(t: float) -> dict[str, float]:
    """60% of answers miss the SLO (late first tokens) while 40 wait and decode meets the ITL SLO."""
    return {**_latency_spike(t), "engine__requests_waiting": 40.0, "engine__itl_seconds__mean": 0.05}


def _levels(breaker: Breaker, fault: Callable[[float], dict[str, float]], total_s: float) -> list[int]:
    state: BreakerState | None = None
    levels = [0]
    for t in range(int(total_s)):
        state, _ = breaker.decide(make_snapshot(float(t), **fault(t)), [], state, float(t))
        if state.level != levels[-1]:
            levels.append(state.level)
    return levels[1:]


def test_a_burn_from_queueing_at_full_capacity_does_not_trip():
    """Halving the batch or moving to fp8 would only lengthen the queue the misses come from."""
    assert _levels(QUEUE_AWARE, _queueing, 2000.0) == []
    # the same signals without the ITL SLO (the breaker cannot tell): it escalates as before
    assert _levels(BREAKER, _queueing, 2000.0) == [1, 2, 3]


def test_a_burn_with_slow_decode_still_trips_while_queueing():
    """A latency spike slows every step: the ITL mean is over the SLO, so it is a fault, not a queue."""

    def spike(t: float) -> dict[str, float]:
        return {**_queueing(t), "engine__itl_seconds__mean": 0.4}

    assert _levels(QUEUE_AWARE, spike, 2000.0) == [1, 2, 3]


def test_a_burn_without_an_itl_reading_still_trips():
    def no_itl(t: float) -> dict[str, float]:
        return {k: v for k, v in _queueing(t).items() if k != "engine__itl_seconds__mean"}

    assert _levels(QUEUE_AWARE, no_itl, 700.0) == [1, 2]


def test_errors_and_preemption_storms_trip_while_queueing():
    def storm(t: float) -> dict[str, float]:
        return {**_queueing(t), "gate__errors": 3.0}

    def thrash(t: float) -> dict[str, float]:
        return {**_queueing(t), "gate__slo_bad": 0.0, "engine__preemptions_per_second": 8.0}

    assert _levels(QUEUE_AWARE, storm, 500.0) == [1, 2]
    assert _levels(QUEUE_AWARE, thrash, 500.0) == [1, 2]


@pytest.mark.parametrize("fault", [_latency_spike, _error_storm, _leak], ids=["latency", "5xx", "leak"])
def test_queue_aware_breaker_still_escalates_and_recovers_in_order_on_faults(fault):
    assert _levels(QUEUE_AWARE, lambda t: fault(t) if t < 1200 else _healthy(t), 4000.0) == [1, 2, 3, 2, 1, 0]


def test_a_burst_of_preemptions_is_no_storm():
    """6 preemptions/s for 10 s (the KV cache binding on a chat trace) stays under 5/s smoothed over 60 s."""

    def burst(t: float) -> dict[str, float]:
        return {**_healthy(t), "engine__preemptions_per_second": 6.0 if 100 <= t < 110 else 0.0}

    def storm(t: float) -> dict[str, float]:
        return {**_healthy(t), "engine__preemptions_per_second": 6.0 if t >= 100 else 0.0}

    assert _levels(BREAKER, burst, 600.0) == []
    assert _levels(BREAKER, storm, 600.0) == [1, 2]


def _prefill_bound(t: float) -> dict[str, float]:
    """Code prompts at a weekday peak: ITL over the SLO because every step carries a 2,048-token chunk
    (16,000 prompt tokens/s against 250 generated: 1.5% of a step's tokens are decodes)."""
    return {
        **_latency_spike(t),
        "engine__itl_seconds__mean": 0.13,
        "engine__prompt_tokens_per_second": 16000.0,
        "engine__generation_tokens_per_second": 250.0,
    }


def test_a_burn_from_prefill_bound_steps_does_not_trip():
    """L1 cannot shorten a step made of a prompt chunk and L2 lengthens it on an A100 (policies/steps.py)."""
    assert _levels(QUEUE_AWARE, _prefill_bound, 2000.0) == []

    # the same ITL with decodes making the steps (chat: a third of the tokens): a fault, it escalates
    def decode_bound(t: float) -> dict[str, float]:
        return {**_prefill_bound(t), "engine__prompt_tokens_per_second": 500.0}

    assert _levels(QUEUE_AWARE, decode_bound, 2000.0) == [1, 2, 3]
    # errors still trip
    assert _levels(QUEUE_AWARE, lambda t: {**_prefill_bound(t), "gate__errors": 3.0}, 500.0) == [1, 2]


def _quiet(answers: float, bad: float, errors: float = 0.0) -> dict[str, float]:
    return {"gate__requests": answers, "gate__slo_bad": bad, "gate__errors": errors, "gate__limit": 128.0}


def test_a_few_bad_answers_at_night_trip_nothing():
    """A quiet service (an answer every 6 minutes) hiccups: three answers in a row fail, a minute apart.
    Their share is far over any burn rate (3 of the hour's 12), and until 2026-12-06 the second of them
    took the breaker to L1, halving the batch for a dwell; so did one 5xx among the five answers of a
    tick (a 20% "storm"). At least min_bad (5) bad answers in the short window are needed now."""
    state = None
    times = [*range(0, 3600, 360), 3600, 3660, 3720, *range(4080, 3 * 3600, 360)]
    for t in times:
        failing = t in (3600, 3660, 3720)
        values = _quiet(1.0, 1.0 if failing else 0.0, 1.0 if failing else 0.0)
        state, _ = BREAKER.decide(make_snapshot(float(t), **values), [], state, float(t))
        assert state.level == 0, t
    state, _ = BREAKER.decide(make_snapshot(1.0, **_quiet(5.0, 1.0, 1.0)), [], None, 1.0)
    assert state.level == 0  # one 5xx in a tick of five answers


def test_5xx_add_up_over_the_last_minute_to_a_storm():
    """Two 5xx a tick among 10 answers: two ticks hold 4 (no storm yet), the third 6 of 30 (20%)."""
    state = None
    levels = []
    for t in range(3):
        # SLO-bad left at 0: the 5xx rule alone (the fast burn would trip on the same third tick)
        state, _ = BREAKER.decide(make_snapshot(float(t), **_quiet(10.0, 0.0, 2.0)), [], state, float(t))
        levels.append(state.level)
    assert levels == [0, 0, 1]
    assert state.reason == "escalate: 5xx storm: 20% of the last minute's answers (>= 5%)"


def test_a_level_that_relieves_nothing_is_probed_down_though_the_burn_goes_on():
    """A latency spike takes the breaker to L1; then decode meets the ITL SLO again but the misses go on:
    late first tokens, from a queue that L1's halved batch only lengthens. b(5 m) stays over 1, so waiting
    for the budget to heal kept L1 for good. On the Mooncake hour with served_classes steering
    (bench/classes.py) a slow burn 202 s in held L1 for the remaining 57 minutes: 42.93% of requests in
    SLO, 57.78% when the breaker comes back down after its dwell."""

    def spike_then_queueing(t: float) -> dict[str, float]:
        return {**_queueing(t), "engine__itl_seconds__mean": 0.4 if t < 400 else 0.05}

    changes = []
    state: BreakerState | None = None
    for t in range(2000):
        state, _ = QUEUE_AWARE.decide(make_snapshot(float(t), **spike_then_queueing(t)), [], state, float(t))
        if state.level != (changes[-1][1] if changes else 0):
            changes.append((t, state.level))
    assert [level for _, level in changes] == [1, 0]
    assert changes[1][0] - changes[0][0] == QUEUE_AWARE.dwell_s  # after its dwell, not before
    assert (state.phase, state.batch_cap) == ("steady", None)  # the probe was committed: L1's cap is gone

    # the spike going on: it escalates after the dwell instead, as before
    assert _levels(QUEUE_AWARE, lambda t: {**_queueing(t), "engine__itl_seconds__mean": 0.4}, 700.0) == [1, 2]
