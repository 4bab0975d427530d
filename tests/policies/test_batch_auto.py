import pytest

from policies.batch_auto import AutoBatch, AutoState
from tests.policies.conftest import make_snapshot

POLICY = AutoBatch(ttft_slo_s=10.0, itl_slo_s=0.1)


def _decide(**values: float) -> list[float]:
    _, proposals = POLICY.decide(make_snapshot(**values), [], None, 0.0)
    return [float(p.value) for p in proposals]


def test_grows_additively_when_queue_waits_and_latency_has_room():
    assert _decide(
        gate__limit=64,
        engine__requests_running=64,
        engine__requests_waiting=10,
        engine__kv_cache_usage_ratio=0.5,
        engine__itl_seconds__mean=0.07,
    ) == [72]


def test_grows_by_the_gradients_square_root_far_below_the_itl_target():
    """A cold start at limit 16 with ITL at a tenth of the SLO doubles instead of adding 4."""
    q = {"engine__requests_waiting": 10, "engine__kv_cache_usage_ratio": 0.1}
    assert _decide(gate__limit=16, engine__requests_running=16, engine__itl_seconds__mean=0.01, **q) == [32]
    # nearer the target: the square root of the gradient, 64 * sqrt(0.08 / 0.04 / 1.1) = 86
    assert _decide(gate__limit=64, engine__requests_running=64, engine__itl_seconds__mean=0.04, **q) == [86]


def test_growth_stops_at_what_the_cache_holds_at_its_target():
    """A cache-bound engine (Mooncake's long chats) runs few sequences, so its ITL sits far below target and
    the gradient's step would put more in it than its cache holds: 31 running at 80% hold ~33 at 85%, so
    the limit grows to 33 + the reserve of 8, not to 39 x 1.35 = 53."""
    bound = {
        "gate__limit": 39,
        "gate__reserved": 8,
        "gate__in_flight": 31,
        "gate__queue_depth": 30,
        "engine__requests_running": 31,
        "engine__itl_seconds__mean": 0.04,
    }
    assert _decide(**bound, engine__kv_cache_usage_ratio=0.8) == [41]
    assert _decide(**bound, engine__kv_cache_usage_ratio=0.84) == [40]  # one step at least
    assert _decide(**bound, engine__kv_cache_usage_ratio=0.2) == [53]  # room in the cache: the gradient
    _, [capped] = POLICY.decide(make_snapshot(**bound, engine__kv_cache_usage_ratio=0.8), [], None, 0.0)
    assert capped.reason.endswith("up to what the cache holds at 85%")
    _, [free] = POLICY.decide(make_snapshot(**bound, engine__kv_cache_usage_ratio=0.2), [], None, 0.0)
    assert "cache holds" not in free.reason


def test_shrinks_when_itl_is_over_target():
    [value] = _decide(gate__limit=64, engine__requests_running=64, engine__itl_seconds__mean=0.1)
    assert value < 64


def test_a_normal_priority_queue_grows_the_limit_behind_the_gates_high_priority_reserve():
    """Normal traffic fills only L - R slots: 51 of 64 with the default 20% reserve, and then it binds."""
    assert _decide(
        gate__limit=64,
        gate__reserved=13,
        gate__in_flight=51,
        gate__queue_depth=30,
        engine__requests_running=51,
        engine__itl_seconds__mean=0.07,
    ) == [72]


def test_the_gates_in_flight_count_stands_in_for_a_sampled_zero_running_gauge():
    """Seen on a real vLLM with a fast model: its gauge read 0 running, the gate had 2 in flight, 19 queued"""
    at_the_gate = {"gate__limit": 8, "gate__in_flight": 8, "engine__requests_running": 0}  # 8: POLICY's floor
    assert _decide(**at_the_gate, gate__queue_depth=19, engine__itl_seconds__mean=0.01) == [16]
    # and the limit shrinks from what is in flight, not from the gauge's 0 down to the floor
    assert _decide(
        gate__limit=16, gate__in_flight=16, engine__requests_running=0, engine__itl_seconds__mean=0.2
    ) == [15]


def test_an_engine_queueing_below_the_gates_limit_does_not_grow_it():
    """The engine's own cap binds (40 running, 11 queued inside it): a larger gate limit would only move the
    gate's queue into the engine's."""
    assert (
        _decide(
            gate__limit=64,
            gate__reserved=13,
            gate__in_flight=51,
            gate__queue_depth=5,
            engine__requests_running=40,
            engine__requests_waiting=11,
            engine__itl_seconds__mean=0.01,
        )
        == []
    )


#: Behind the gate at 64, an engine with 4 slots runs 4 and queues 43 of the gate's requests itself.
ENGINE_CAPPED = {
    "gate__limit": 64,
    "gate__reserved": 12,
    "gate__in_flight": 47,
    "gate__queue_depth": 0,
    "engine__requests_running": 4,
    "engine__requests_waiting": 43,
    "engine__kv_cache_usage_ratio": 0.3,
    "engine__itl_seconds__mean": 0.01,
}


def _ticks(values: list[dict[str, float]], policy: AutoBatch = POLICY) -> list[list[float]]:
    """Proposals tick by tick, the state carried over as the sidecar's loop carries it."""
    state: AutoState | None = None
    out = []
    for t, tick in enumerate(values):
        state, proposals = policy.decide(make_snapshot(float(t), **tick), [], state, float(t))
        out.append([float(p.value) for p in proposals])
    return out


def test_an_engine_queueing_the_gates_requests_tick_after_tick_brings_the_limit_down_to_it():
    """Requests queued in the engine wait FIFO, past the gate's priorities: after 5 ticks the limit comes
    down to what runs, the reserve and a slack of 2 for the engine to admit from (4 + 12 + 2)."""
    assert _ticks([ENGINE_CAPPED] * 6) == [[], [], [], [], [18], [18]]


def test_an_engine_that_says_its_slots_gets_a_limit_its_slots_take_at_once():
    """llama.cpp says its 4 slots (/slots): the limit comes down on the first tick, not after five of its
    queue, to the slots, a slack of 2 and the high reserve (20% of the limit): 6 / 0.8 = 7.5 -> 8."""
    slots = {**ENGINE_CAPPED, "engine__slots_total": 4}
    assert _ticks([slots]) == [[8]]
    policy = AutoBatch(ttft_slo_s=10.0, itl_slo_s=0.1, lower=2.0)  # under the default floor of 8
    at_16 = {**slots, "engine__slots_total": 16, "gate__limit": 64, "gate__reserved": 12.8}
    assert _ticks([at_16], policy) == [[25]]  # (16 + 4) / 0.8
    no_gate = {k: v for k, v in slots.items() if not k.startswith("gate__")}
    assert _ticks([no_gate]) == [[]]  # without the gate the batch is the engine's own


def test_a_limit_does_not_grow_past_what_the_engine_slots_take():
    """A queue at the gate with ITL far under target grows a limit (16 -> 32), but only as far as 16 slots
    take (16 + 4 slack, over 0.8: 25), and not at all from there."""
    bound = {
        "gate__limit": 16,
        "gate__reserved": 3.2,
        "gate__in_flight": 16,
        "gate__queue_depth": 10,
        "engine__requests_running": 16,
        "engine__requests_waiting": 0,
        "engine__kv_cache_usage_ratio": 0.1,
        "engine__itl_seconds__mean": 0.01,
    }
    assert _ticks([bound]) == [[32]]
    assert _ticks([{**bound, "engine__slots_total": 16}]) == [[25]]
    at_25 = {
        **bound,
        "engine__slots_total": 16,
        "gate__limit": 25,
        "gate__reserved": 5,
        "gate__in_flight": 25,
    }
    assert _ticks([at_25]) == [[]]  # bound, queued and far under the ITL target: held at what slots take
    assert _ticks([{k: v for k, v in at_25.items() if k != "engine__slots_total"}]) == [[50]]


def test_a_tick_without_the_engine_queue_starts_the_count_again():
    quiet = {**ENGINE_CAPPED, "engine__requests_waiting": 2}  # no more than the slack: not the engine's cap
    assert _ticks([ENGINE_CAPPED] * 4 + [quiet] + [ENGINE_CAPPED] * 4) == [[]] * 9
    assert _ticks([ENGINE_CAPPED] * 4 + [quiet] + [ENGINE_CAPPED] * 5)[-1] == [18]


def test_the_slack_grows_with_what_the_engine_runs():
    """256 running and 100 queued in the engine: a slack of 16 (the square root), the limit 256 + 64 + 16."""
    big = {**ENGINE_CAPPED, "gate__limit": 420, "gate__reserved": 64, "gate__in_flight": 356}
    big.update(engine__requests_running=256, engine__requests_waiting=100)
    assert _ticks([big] * 5)[-1] == [336]


def test_a_sampled_empty_engine_does_not_grow_a_limit_the_engine_was_seen_to_cap():
    """After the cut to 18 the engine runs 4 and queues the rest of the 14 normal slots' requests; then
    one scrape reads 0 running, 0 waiting. With 14 in flight the gate looks bound (14 >= 18 - 3 - 1) and
    the ITL has room, but the engine's smoothed queue says its own cap still binds: no growth. Without
    that history the same tick grows (18 -> 36: ITL at a tenth of its target)."""
    after = {
        **ENGINE_CAPPED,
        "gate__limit": 18,
        "gate__reserved": 3,
        "gate__in_flight": 14,
        "gate__queue_depth": 40,
        "engine__requests_waiting": 10,
    }
    blank = {**after, "engine__requests_running": 0, "engine__requests_waiting": 0}
    assert _ticks([ENGINE_CAPPED] * 5 + [after] * 4 + [blank])[-1] == []
    assert _ticks([blank]) == [[36]]


#: vLLM (CPU, --max-num-seqs 4) behind the gate at 11, slowed: it runs 4 and queues 5 of the gate's.
VLLM_CAPPED = {
    "gate__limit": 11,
    "gate__reserved": 2.2,
    "gate__in_flight": 9,
    "gate__queue_depth": 3,
    "engine__requests_running": 4,
    "engine__requests_waiting": 5,
    "engine__kv_cache_usage_ratio": 0.01,
    "engine__itl_seconds__mean": 0.009,
}
#: After the cut to 8 (4 running + 2.2 reserve + 2 slack): the engine keeps its slack, less what is in
#: transit to its scheduler (counted in neither of its gauges), so the gate looks bound (7 in flight,
#: 1 queued) with the engine's own queue under its slack, ITL far under target.
AT_ITS_CAP = {
    **VLLM_CAPPED,
    "gate__limit": 8,
    "gate__reserved": 1.6,
    "gate__in_flight": 7,
    "gate__queue_depth": 1,
    "engine__requests_waiting": 1,
}


def test_a_limit_brought_down_to_the_engines_cap_does_not_grow_past_it_again():
    """Seen on vLLM's CPU backend slowed by a CPU hog: the limit went 8 -> 12 -> 8 -> 12 within two minutes.
    At the cut the limit leaves the engine its slack queued, so the growth rule's guard (the engine's
    smoothed queue within its slack) held at the equilibrium, and the limit grew into the engine's queue
    again. Once the engine was seen to queue at 4 running, the limit grows no further than 4 takes."""
    ticks = _ticks([VLLM_CAPPED] * 5 + [AT_ITS_CAP] * 30)
    assert ticks[4] == [8]
    assert ticks[5:] == [[]] * 30
    # a policy that never saw the engine queue grows the same tick: it does not know the cap
    assert _ticks([AT_ITS_CAP]) == [[16]]
    # a limit set under what the cap takes (floor 2) grows to it, 4 + 1 + 2, not to 10
    policy = AutoBatch(ttft_slo_s=10.0, itl_slo_s=0.1, lower=2.0)
    under = {**AT_ITS_CAP, "gate__limit": 5, "gate__reserved": 1.0, "gate__in_flight": 5}
    state: AutoState | None = None
    for t, tick in enumerate([VLLM_CAPPED] * 5 + [AT_ITS_CAP] * 15 + [under]):
        state, proposals = policy.decide(make_snapshot(float(t), **tick), [], state, float(t))
    assert [(p.value, p.reason.endswith("(it queued at 4 running)")) for p in proposals] == [(7, True)]


def test_the_cap_seen_is_forgotten_once_the_engine_runs_more():
    """A cap that rose (shorter requests fit more in a KV-bound engine, or a restart with a larger
    max_num_seqs): the engine runs more than it did when it queued, and the limit may grow again."""
    more = {**AT_ITS_CAP, "engine__requests_running": 6, "gate__in_flight": 7, "engine__requests_waiting": 0}
    ticks = _ticks([VLLM_CAPPED] * 5 + [AT_ITS_CAP] * 15 + [more] * 15)
    assert ticks[5:20] == [[]] * 15
    assert any(t and t[0] > 8 for t in ticks[20:])


def test_an_engine_queue_is_left_alone_without_a_gate_with_a_full_cache_or_for_a_small_cut():
    no_gate = {k: v for k, v in ENGINE_CAPPED.items() if not k.startswith("gate__")}
    assert _ticks([no_gate] * 8) == [[]] * 8  # the replay's engine alone: its queue is the only one
    full = {**ENGINE_CAPPED, "engine__kv_cache_usage_ratio": 0.95}
    assert _ticks([full] * 8) == [[]] * 8  # the cache binds: the engine admits as blocks free
    close = {**ENGINE_CAPPED, "gate__limit": 19}  # 19 -> 18 is no cut worth a change
    assert _ticks([close] * 8) == [[]] * 8


#: A tick with the KV cache full, one preemption, a queue and ITL far below target.
FULL = {
    "gate__limit": 256,
    "engine__requests_running": 80,
    "engine__requests_waiting": 10,
    "engine__preemptions_per_second": 1.0,
    "engine__kv_cache_usage_ratio": 0.99,
    "engine__itl_seconds__mean": 0.03,
}


def test_backs_off_below_running_on_a_sustained_preemption_storm():
    storm = AutoState(256.0, preempt_rate=3.0, at=99.0)
    _, proposals = POLICY.decide(make_snapshot(100.0, **FULL), [], storm, 100.0)
    assert [p.value for p in proposals] == [76]


def test_a_full_cache_with_occasional_preemptions_holds_instead_of_cutting():
    """The cache binding is not thrash: hold (no cut, no growth) while the smoothed rate is low."""
    calm = AutoState(256.0, preempt_rate=0.1, at=99.0)
    state, proposals = POLICY.decide(make_snapshot(100.0, **FULL), [], calm, 100.0)
    assert proposals == []
    assert state is not None and 0.1 < state.preempt_rate < 1.0  # smoothed: one tick moves it a little


def test_a_full_cache_without_preemptions_does_not_cut():
    values = {**FULL, "engine__preemptions_per_second": 0.0}
    assert _decide(**values) == []


def test_does_not_grow_in_a_tick_with_preemptions():
    values = {**FULL, "gate__limit": 80, "engine__kv_cache_usage_ratio": 0.5}
    assert _decide(**values) == []
    assert _decide(**{**values, "engine__preemptions_per_second": 0.0}) != []  # the same tick, none: grows


def test_the_smoothed_rate_reaches_the_threshold_only_when_preemptions_persist():
    """3 preemptions/s: a 5-s burst stays under 2/s smoothed (tau 30 s); 40 s of it crosses."""
    state = AutoState(256.0)
    for t in range(1, 6):
        state, proposals = POLICY.decide(
            make_snapshot(float(t), **{**FULL, "engine__preemptions_per_second": 3.0}), [], state, float(t)
        )
        assert proposals == []
    cut_at = None
    for t in range(6, 60):
        state, proposals = POLICY.decide(
            make_snapshot(float(t), **{**FULL, "engine__preemptions_per_second": 3.0}), [], state, float(t)
        )
        if proposals and cut_at is None:
            cut_at = t
    assert cut_at is not None and 25 <= cut_at <= 40


def test_does_not_grow_a_limit_that_does_not_bind():
    assert (
        _decide(
            gate__limit=64,
            engine__requests_running=20,
            engine__requests_waiting=0,
            engine__itl_seconds__mean=0.02,
        )
        == []
    )


def test_does_not_grow_when_kv_cache_is_near_full():
    assert (
        _decide(
            gate__limit=64,
            engine__requests_running=64,
            engine__requests_waiting=10,
            engine__kv_cache_usage_ratio=0.9,
            engine__itl_seconds__mean=0.02,
        )
        == []
    )


def test_holds_without_engine_reading():
    assert _decide(gate__limit=64) == []


def test_clamps_to_upper_bound():
    policy = AutoBatch(10.0, 0.1, upper=70.0)
    snapshot = make_snapshot(
        gate__limit=68,
        engine__requests_running=68,
        engine__requests_waiting=5,
        engine__kv_cache_usage_ratio=0.1,
        engine__itl_seconds__mean=0.01,
    )
    _, proposals = policy.decide(snapshot, [], None, 0.0)
    assert proposals[0].value == 70


def test_a_limit_outside_the_bounds_is_brought_back_where_it_would_otherwise_hold():
    """The gate may start above ``upper`` (its own ``max_in_flight``), and a config reload may narrow the
    bounds below the limit in force: an idle engine, where the controller holds, must not keep it there."""
    policy = AutoBatch(10.0, 0.1, lower=8.0, upper=32.0, initial=16.0)
    idle = {"engine__requests_running": 2, "engine__itl_seconds__mean": 0.01}
    for limit, expected in ((64, 32), (4, 8)):
        state, [proposal] = policy.decide(make_snapshot(gate__limit=limit, **idle), [], None, 0.0)
        assert (proposal.value, state.limit) == (expected, expected)
        assert f"limit {limit} outside the policy's bounds [8, 32]" == proposal.reason
    assert policy.decide(make_snapshot(gate__limit=20, **idle), [], None, 0.0)[1] == []  # inside: holds
    # without a gate the limit is the controller's own, carried in its state
    _, [proposal] = policy.decide(make_snapshot(**idle), [], AutoState(limit=100.0), 0.0)
    assert proposal.value == 32


def test_rejects_a_zero_slo():
    with pytest.raises(ValueError, match="SLO"):
        AutoBatch(0.0, 0.1)


def _run(policy: AutoBatch, values: dict[str, float], ticks: int) -> tuple[AutoState | None, list[float]]:
    """Tick once a second on the same signals; the limit each proposal asks for."""
    state: AutoState | None = None
    limits = []
    for t in range(ticks):
        snapshot = make_snapshot(
            float(t), **{**values, "gate__limit": state.limit if state else values["gate__limit"]}
        )
        state, proposals = policy.decide(snapshot, [], state, float(t))
        limits += [float(p.value) for p in proposals]
    return state, limits


#: The Azure 2024 coding week's weekday peak on an engine with a 2,048-token budget: ITL over target because
#: each step carries a prompt chunk (1.5% of a step's tokens are decodes), a queue waiting for the batch.
PREFILL_BOUND = {
    "gate__limit": 256,
    "engine__requests_running": 26,
    "engine__requests_waiting": 30,
    "engine__requests_finished_per_second": 8.0,  # a 4-s wait for the queue: no TTFT risk
    "engine__kv_cache_usage_ratio": 0.3,
    "engine__itl_seconds__mean": 0.13,
    "engine__prompt_tokens_per_second": 16000.0,
    "engine__generation_tokens_per_second": 250.0,
}


def test_itl_of_prefill_bound_steps_does_not_cut_the_batch():
    """Cutting it (to 8-20 on that peak) only queued requests: 895 waiting, no better ITL."""
    state, limits = _run(POLICY, PREFILL_BOUND, 120)
    assert limits == [] and state is not None and state.limit == 256
    assert state.mix.decode_share == pytest.approx(250 / 16250, rel=0.01)
    # the same ITL with decodes making up a third of the steps: the batch is the lever, it is cut
    decode_bound = {**PREFILL_BOUND, "engine__prompt_tokens_per_second": 500.0}
    _, limits = _run(POLICY, decode_bound, 120)
    assert limits and limits[-1] < 26


def test_prompt_tokens_the_prefix_cache_served_are_no_prefill():
    """vLLM counts its prefix cache's hits among its prompt tokens. The same 16,000 prompt tokens/s with
    15,500 of them cache hits (a chat's history) leave 500 computed: a third of the steps' tokens are
    decodes, and the ITL over target is the batch's to cut. Without the computed rate (SGLang, an older
    vLLM), the total is all there is, and the steps read as prefill-bound."""
    cached = {**PREFILL_BOUND, "engine__prompt_tokens_computed_per_second": 500.0}
    state, limits = _run(POLICY, cached, 120)
    assert state is not None and state.mix.decode_share == pytest.approx(250 / 750, rel=0.01)
    assert limits and limits[-1] < 26
    all_computed = {**PREFILL_BOUND, "engine__prompt_tokens_computed_per_second": 16000.0}
    assert _run(POLICY, all_computed, 120)[1] == []


def test_a_binding_limit_grows_on_its_queue_while_the_steps_are_prefill_bound():
    bound = {**PREFILL_BOUND, "gate__limit": 24, "engine__requests_running": 24}
    state, limits = _run(POLICY, bound, 60)
    assert limits and limits[0] > 24
    _, [proposal] = POLICY.decide(make_snapshot(100.0, **bound), [], state, 100.0)
    assert "prompt chunks" in proposal.reason and "1.5% of a step's tokens are decodes" in proposal.reason
    assert _decide(**bound) == [29]  # on the first tick too: its rates are taken as they are
